//! Idempotency records in Redis.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{FromRedisValue, Script, ScriptInvocation, Value};
use tokio::sync::OnceCell;

use super::{
    Begin, Claim, Fingerprint, LeaseState, RecordKey, Store, StoreError, StoredResponse, Ttl,
};

/// The default key prefix of a [`RedisStore`]: `resend:idempotency:`.
pub const DEFAULT_PREFIX: &str = "resend:idempotency:";

/// How long [`RedisStore::open`]'s store may take to connect, by default.
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

// A record is one string value: `L` + fingerprint (32 bytes) + lease token
// (32 hex digits) while the work runs, `D` + fingerprint + token + encoded
// response once it is done (the token kept, so that a holder whose first
// `complete` answer was lost finds its own record). In Lua, strings count
// from 1: the kind is byte 1, the fingerprint bytes 2 to 33, the token
// bytes 34 to 65, the response from byte 66.

/// Takes the lease with `SET NX PX`, or returns what holds the key, in one
/// step.
const BEGIN: &str = r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
return redis.call('GET', KEYS[1])
";

/// Extends the lease, only if it is still ours; writes it anew (`ARGV[3]`)
/// if the key has no record (Redis lost it, or it expired unclaimed).
/// Returns 1 when the lease is ours, 2 when the key holds our own finished
/// record (our response is stored: nothing to renew), 0 when another
/// request holds the key.
const RENEW: &str = r"
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])
  return 1
end
if string.sub(v, 34, 65) ~= ARGV[1] then
  return 0
end
if string.sub(v, 1, 1) == 'L' then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 2
";

/// Replaces the lease with the response (keeping the fingerprint), only if
/// the lease is still ours; writes the finished record anew (with the
/// fingerprint `ARGV[4]`) if the key has no record. Returns 1 when stored
/// (or stored already, by us), 0 when another request holds the key.
const COMPLETE: &str = r"
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('SET', KEYS[1], 'D' .. ARGV[4] .. ARGV[1] .. ARGV[2], 'PX', ARGV[3])
  return 1
end
local kind, token = string.sub(v, 1, 1), string.sub(v, 34, 65)
if token ~= ARGV[1] then
  return 0
end
if kind == 'L' then
  redis.call('SET', KEYS[1], 'D' .. string.sub(v, 2, 33) .. ARGV[1] .. ARGV[2], 'PX', ARGV[3])
end
return 1
";

/// Deletes the lease, only if it is still ours.
const RELEASE: &str = r"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, 1) == 'L' and string.sub(v, 34) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// Idempotency records in Redis or Redis Cluster (feature `redis`).
///
/// The lease is taken with `SET NX PX` (expiring by itself if its holder
/// dies, renewed by `PEXPIRE` while it lives), the response is stored with a
/// TTL in its place, and the steps that must not interleave with another
/// request's (take or read; compare the token and extend or replace; compare
/// and delete) are Lua scripts, atomic in Redis. A record that Redis lost
/// while its handler ran (a restart without persistence) is written anew by
/// the holder's next renewal or by its response. While Redis cannot be
/// reached, requests with a key get 503.
///
/// # Connections
///
/// Three ways to reach Redis, the same records and scripts on each:
///
/// - [`RedisStore::new`]: on the application's own
///   [`ConnectionManager`], with its settings (timeouts, retries, TLS,
///   credentials), shared with the rest of the application;
/// - [`RedisStore::cluster`]: on the application's Redis Cluster
///   connection ([`ClusterConnection`]), which routes each call to the node
///   that holds the record's slot and follows the cluster's redirections;
/// - [`RedisStore::open`]: from a URL, a connection manager of the store's
///   own, made on first use and remade after a failure
///   ([`connect_timeout`](RedisStore::connect_timeout) bounds making it).
///
/// # Keys
///
/// A record is one Redis string, under the key
/// `<prefix>{<scope length>:<scope>:<key>}`: the [prefix](RedisStore::prefix)
/// (default [`DEFAULT_PREFIX`]), then, in braces, the length of the caller's
/// scope in decimal bytes, the scope and the Idempotency-Key. The length
/// comes first so that no (scope, key) pair can be written like another
/// (`1:a:b:c` is scope `a` with key `b:c`, never scope `a:b`). The braces are
/// a Redis Cluster *hash tag*: the cluster hashes only what is between them,
/// so every key made for one record with the same tag lands in one slot, and
/// each script touches exactly one key (`KEYS[1]`), as a cluster requires.
/// Records of different keys spread over all slots.
///
/// Redis takes the tag from the first `{` to the next `}`, so the
/// characters around it only change how records spread, never whether a
/// record stays whole: a `}` in the scope or the Idempotency-Key ends the
/// tag early (records that agree up to it share a slot); a prefix with a `{`
/// of its own moves the tag into the prefix, and one with a whole `{..}` puts
/// every record in that one slot. Keep braces out of the prefix.
///
/// ```no_run
/// use tower_resend_server::{IdempotencyLayer, RedisStore};
///
/// let store = RedisStore::open("redis://127.0.0.1:6379")?.prefix("orders:idempotency:");
/// let layer = IdempotencyLayer::new(store);
/// # let _ = layer;
/// # Ok::<(), tower_resend_server::StoreError>(())
/// ```
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
    prefix: Arc<str>,
    scripts: Arc<Scripts>,
}

/// The four transitions, each a script on one key.
struct Scripts {
    begin: Script,
    renew: Script,
    complete: Script,
    release: Script,
}

/// How a [`RedisStore`] reaches Redis.
#[derive(Clone)]
enum Conn {
    /// From a URL: a connection manager made on first use.
    Url {
        client: redis::Client,
        manager: Arc<OnceCell<ConnectionManager>>,
        connect_timeout: Duration,
    },
    /// The application's connection manager.
    Manager(ConnectionManager),
    /// The application's Redis Cluster connection.
    Cluster(ClusterConnection),
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("RedisStore");
        match &self.conn {
            Conn::Url { client, .. } => d.field("server", &client.get_connection_info().addr()),
            Conn::Manager(_) => d.field("server", &"the application's connection manager"),
            Conn::Cluster(_) => d.field("server", &"the application's cluster connection"),
        };
        d.field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

fn redis_error(what: &'static str) -> impl FnOnce(redis::RedisError) -> StoreError {
    move |e| StoreError::with_source(what, e)
}

impl RedisStore {
    fn with_conn(conn: Conn) -> Self {
        Self {
            conn,
            prefix: DEFAULT_PREFIX.into(),
            scripts: Arc::new(Scripts {
                begin: Script::new(BEGIN),
                renew: Script::new(RENEW),
                complete: Script::new(COMPLETE),
                release: Script::new(RELEASE),
            }),
        }
    }

    /// A store on the application's own connection manager: its settings
    /// (timeouts, reconnection, TLS, credentials) are the application's.
    /// The manager is shared, not owned: the store uses clones of it.
    ///
    /// ```no_run
    /// use tower_resend_server::{IdempotencyLayer, RedisStore};
    ///
    /// # async fn demo() -> Result<(), redis::RedisError> {
    /// let client = redis::Client::open("redis://127.0.0.1:6379")?;
    /// let manager = client.get_connection_manager().await?;
    /// let layer = IdempotencyLayer::new(RedisStore::new(manager.clone()));
    /// # let _ = layer;
    /// # Ok(())
    /// # }
    /// ```
    pub fn new(manager: ConnectionManager) -> Self {
        Self::with_conn(Conn::Manager(manager))
    }

    /// A store on the application's Redis Cluster connection: each call
    /// goes to the node that holds the record's slot (see the type's docs
    /// on keys), redirections and failovers handled by the connection.
    ///
    /// ```no_run
    /// use redis::cluster::ClusterClient;
    /// use tower_resend_server::{IdempotencyLayer, RedisStore};
    ///
    /// # async fn demo() -> Result<(), redis::RedisError> {
    /// let nodes = ["redis://10.0.0.1:6379", "redis://10.0.0.2:6379", "redis://10.0.0.3:6379"];
    /// let conn = ClusterClient::new(nodes)?.get_async_connection().await?;
    /// let layer = IdempotencyLayer::new(RedisStore::cluster(conn));
    /// # let _ = layer;
    /// # Ok(())
    /// # }
    /// ```
    pub fn cluster(conn: ClusterConnection) -> Self {
        Self::with_conn(Conn::Cluster(conn))
    }

    /// A store on the Redis server at `url` (`redis://host:port/db`), on a
    /// connection manager of its own. Only reads the URL: the connection is
    /// made on first use (within [`connect_timeout`](Self::connect_timeout)),
    /// and remade after a failure.
    pub fn open(url: &str) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(redis_error("invalid Redis URL"))?;
        Ok(Self::with_conn(Conn::Url {
            client,
            manager: Arc::new(OnceCell::new()),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
        }))
    }

    /// Prefixes every key with `prefix`. Default [`DEFAULT_PREFIX`]. The
    /// prefix stays outside the hash tag; keep `{` and `}` out of it (see
    /// the type's docs on keys).
    #[must_use]
    pub fn prefix(mut self, prefix: impl Into<Arc<str>>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long making the store's own connection may take. Default 1 s.
    ///
    /// Only for a store made by [`open`](Self::open): one on the
    /// application's connection ([`new`](Self::new),
    /// [`cluster`](Self::cluster)) keeps that connection's settings, and
    /// this does nothing to it.
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        if let Conn::Url {
            connect_timeout, ..
        } = &mut self.conn
        {
            *connect_timeout = timeout;
        }
        self
    }

    /// Runs one script call on whichever connection the store has.
    async fn invoke<T: FromRedisValue>(
        &self,
        call: &ScriptInvocation<'_>,
        what: &'static str,
    ) -> Result<T, StoreError> {
        let result = match &self.conn {
            Conn::Url {
                client,
                manager,
                connect_timeout,
            } => {
                let manager = manager
                    .get_or_try_init(|| async {
                        let config = ConnectionManagerConfig::new()
                            .set_connection_timeout(Some(*connect_timeout))
                            .set_number_of_retries(1);
                        client
                            .get_connection_manager_with_config(config)
                            .await
                            .map_err(redis_error("cannot connect to Redis"))
                    })
                    .await?;
                call.invoke_async(&mut manager.clone()).await
            }
            Conn::Manager(manager) => call.invoke_async(&mut manager.clone()).await,
            Conn::Cluster(conn) => call.invoke_async(&mut conn.clone()).await,
        };
        result.map_err(redis_error(what))
    }

    /// The record's Redis key: `<prefix>{<scope length>:<scope>:<key>}`.
    fn redis_key(&self, key: &RecordKey<'_>) -> Vec<u8> {
        let len = key.scope.len().to_string();
        let mut k =
            Vec::with_capacity(self.prefix.len() + len.len() + key.scope.len() + key.key.len() + 4);
        k.extend_from_slice(self.prefix.as_bytes());
        // The hash tag: all of the record's keys in one cluster slot.
        k.push(b'{');
        // The scope's length first, so no scope and key can pass for another.
        k.extend_from_slice(len.as_bytes());
        k.push(b':');
        k.extend_from_slice(key.scope.as_bytes());
        k.push(b':');
        k.extend_from_slice(key.key.as_bytes());
        k.push(b'}');
        k
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

fn record(kind: u8, fingerprint: Fingerprint, rest: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(33 + rest.len());
    v.push(kind);
    v.extend_from_slice(&fingerprint.0);
    v.extend_from_slice(rest);
    v
}

fn parse(value: &[u8]) -> Result<Begin, StoreError> {
    let bad = || StoreError::new("unreadable record in Redis");
    if value.len() < 33 {
        return Err(bad());
    }
    let mut fp = [0; 32];
    fp.copy_from_slice(&value[1..33]);
    let fingerprint = Fingerprint(fp);
    match value[0] {
        b'L' => Ok(Begin::InProgress { fingerprint }),
        b'D' => Ok(Begin::Completed {
            fingerprint,
            response: Box::new(
                StoredResponse::decode(value.get(65..).ok_or_else(bad)?).ok_or_else(bad)?,
            ),
        }),
        _ => Err(bad()),
    }
}

/// What a renewal or completion script answered.
fn lease_state(v: i64) -> Result<LeaseState, StoreError> {
    match v {
        1 => Ok(LeaseState::Held),
        2 => Ok(LeaseState::Completed),
        0 => Ok(LeaseState::Lost),
        _ => Err(StoreError::new("unexpected answer from Redis")),
    }
}

impl Store for RedisStore {
    fn begin(
        &self,
        claim: &Claim<'_>,
        ttl: Ttl,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send {
        let rkey = self.redis_key(&claim.key);
        let lease = record(b'L', claim.fingerprint, &claim.token.to_hex());
        async move {
            let mut call = self.scripts.begin.key(rkey);
            call.arg(lease).arg(millis(ttl.lease));
            // A record that expires between the SET and the GET reads as
            // nil: try again (a few times at most).
            for _ in 0..3 {
                let v: Value = self.invoke(&call, "Redis lease failed").await?;
                match v {
                    Value::Int(1) => return Ok(Begin::Acquired),
                    Value::BulkString(bytes) => return parse(&bytes),
                    Value::Nil => continue,
                    _ => return Err(StoreError::new("unexpected answer from Redis")),
                }
            }
            Err(StoreError::new("Redis record kept vanishing"))
        }
    }

    fn renew(
        &self,
        claim: &Claim<'_>,
        ttl: Ttl,
    ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send {
        let rkey = self.redis_key(&claim.key);
        let token = claim.token.to_hex();
        let lease = record(b'L', claim.fingerprint, &token);
        async move {
            let mut call = self.scripts.renew.key(rkey);
            call.arg(&token[..]).arg(millis(ttl.lease)).arg(lease);
            lease_state(self.invoke(&call, "Redis lease renewal failed").await?)
        }
    }

    fn complete(
        &self,
        claim: &Claim<'_>,
        response: &StoredResponse,
        ttl: Ttl,
    ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send {
        let rkey = self.redis_key(&claim.key);
        let token = claim.token.to_hex();
        let fingerprint = claim.fingerprint;
        let response = response.encode();
        async move {
            let mut call = self.scripts.complete.key(rkey);
            call.arg(&token[..])
                .arg(response)
                .arg(millis(ttl.record))
                .arg(&fingerprint.0[..]);
            lease_state(
                self.invoke(&call, "Redis store of the response failed")
                    .await?,
            )
        }
    }

    fn release(&self, claim: &Claim<'_>) -> impl Future<Output = Result<(), StoreError>> + Send {
        let rkey = self.redis_key(&claim.key);
        let token = claim.token.to_hex();
        async move {
            let mut call = self.scripts.release.key(rkey);
            call.arg(&token[..]);
            let _: i64 = self.invoke(&call, "Redis release failed").await?;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_of(store: &RedisStore, scope: &str, key: &str) -> String {
        String::from_utf8(store.redis_key(&RecordKey { scope, key })).unwrap()
    }

    #[test]
    fn a_record_key_is_its_prefix_and_a_hash_tag() {
        let store = RedisStore::open("redis://127.0.0.1:1").unwrap();
        assert_eq!(
            key_of(&store, "tenant", "order-1"),
            "resend:idempotency:{6:tenant:order-1}"
        );
        let store = store.prefix("p:");
        assert_eq!(key_of(&store, "", "k"), "p:{0::k}");
        // The scope's length keeps pairs apart that would read alike.
        assert_ne!(key_of(&store, "a", "b:c"), key_of(&store, "a:b", "c"));
        assert_eq!(key_of(&store, "a", "b:c"), "p:{1:a:b:c}");
        assert_eq!(key_of(&store, "a:b", "c"), "p:{3:a:b:c}");
    }
}
