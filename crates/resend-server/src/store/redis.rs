//! Idempotency records in Redis.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Script, Value};
use tokio::sync::OnceCell;

use super::{
    Begin, Claim, Fingerprint, LeaseState, RecordKey, Store, StoreError, StoredResponse, Ttl,
};

/// The default key prefix of a [`RedisStore`]: `resend:idempotency:`.
pub const DEFAULT_PREFIX: &str = "resend:idempotency:";

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
/// Returns 1 when the lease is ours, 0 when another request holds the key.
const RENEW: &str = r"
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])
  return 1
end
if string.sub(v, 1, 1) == 'L' and string.sub(v, 34) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
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

/// Idempotency records in Redis (feature `redis`).
///
/// The lease is taken with `SET NX PX` (expiring by itself if its holder
/// dies, renewed by `PEXPIRE` while it lives), the response is stored with a
/// TTL in its place, and the steps that must not interleave with another
/// request's (take or read; compare the token and extend or replace; compare
/// and delete) are Lua scripts, atomic in Redis. A record that Redis lost
/// while its handler ran (a restart without persistence) is written anew by
/// the holder's next renewal or by its response.
/// The connection is made on first use and remade after a failure; while
/// Redis cannot be reached, requests with a key get 503.
///
/// ```no_run
/// use resend_server::{IdempotencyLayer, RedisStore};
///
/// let store = RedisStore::open("redis://127.0.0.1:6379")?.prefix("orders:idempotency:");
/// let layer = IdempotencyLayer::new(store);
/// # let _ = layer;
/// # Ok::<(), resend_server::StoreError>(())
/// ```
#[derive(Clone)]
pub struct RedisStore {
    client: redis::Client,
    conn: Arc<OnceCell<ConnectionManager>>,
    prefix: Arc<str>,
    scripts: Arc<[Script; 4]>,
    connect_timeout: Duration,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("server", &self.client.get_connection_info().addr())
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn redis_error(what: &'static str) -> impl FnOnce(redis::RedisError) -> StoreError {
    move |e| StoreError::with_source(what, e)
}

impl RedisStore {
    /// A store on the Redis server at `url` (`redis://host:port/db`). Only
    /// reads the URL: the connection is made on first use.
    pub fn open(url: &str) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(redis_error("invalid Redis URL"))?;
        Ok(Self {
            client,
            conn: Arc::new(OnceCell::new()),
            prefix: DEFAULT_PREFIX.into(),
            scripts: Arc::new([
                Script::new(BEGIN),
                Script::new(RENEW),
                Script::new(COMPLETE),
                Script::new(RELEASE),
            ]),
            connect_timeout: Duration::from_secs(1),
        })
    }

    /// Prefixes every key with `prefix`. Default [`DEFAULT_PREFIX`].
    #[must_use]
    pub fn prefix(mut self, prefix: impl Into<Arc<str>>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long making a connection may take. Default 1 s.
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    async fn conn(&self) -> Result<ConnectionManager, StoreError> {
        let conn = self
            .conn
            .get_or_try_init(|| async {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.connect_timeout))
                    .set_number_of_retries(1);
                self.client
                    .get_connection_manager_with_config(config)
                    .await
                    .map_err(redis_error("cannot connect to Redis"))
            })
            .await?;
        Ok(conn.clone())
    }

    fn redis_key(&self, key: &RecordKey<'_>) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.prefix.len() + key.scope.len() + key.key.len() + 12);
        k.extend_from_slice(self.prefix.as_bytes());
        // The scope's length first, so no scope and key can pass for another.
        k.extend_from_slice(key.scope.len().to_string().as_bytes());
        k.push(b':');
        k.extend_from_slice(key.scope.as_bytes());
        k.push(b':');
        k.extend_from_slice(key.key.as_bytes());
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
            response: StoredResponse::decode(value.get(65..).ok_or_else(bad)?).ok_or_else(bad)?,
        }),
        _ => Err(bad()),
    }
}

/// What a renewal or completion script answered.
fn lease_state(v: i64) -> Result<LeaseState, StoreError> {
    match v {
        1 => Ok(LeaseState::Held),
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
            let mut conn = self.conn().await?;
            // A record that expires between the SET and the GET reads as
            // nil: try again (a few times at most).
            for _ in 0..3 {
                let v: Value = self.scripts[0]
                    .key(&rkey)
                    .arg(&lease)
                    .arg(millis(ttl.lease))
                    .invoke_async(&mut conn)
                    .await
                    .map_err(redis_error("Redis lease failed"))?;
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
            let mut conn = self.conn().await?;
            let v: i64 = self.scripts[1]
                .key(&rkey)
                .arg(&token[..])
                .arg(millis(ttl.lease))
                .arg(lease)
                .invoke_async(&mut conn)
                .await
                .map_err(redis_error("Redis lease renewal failed"))?;
            lease_state(v)
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
            let mut conn = self.conn().await?;
            let v: i64 = self.scripts[2]
                .key(&rkey)
                .arg(&token[..])
                .arg(response)
                .arg(millis(ttl.record))
                .arg(&fingerprint.0[..])
                .invoke_async(&mut conn)
                .await
                .map_err(redis_error("Redis store of the response failed"))?;
            lease_state(v)
        }
    }

    fn release(&self, claim: &Claim<'_>) -> impl Future<Output = Result<(), StoreError>> + Send {
        let rkey = self.redis_key(&claim.key);
        let token = claim.token.to_hex();
        async move {
            let mut conn = self.conn().await?;
            let _: i64 = self.scripts[3]
                .key(&rkey)
                .arg(&token[..])
                .invoke_async(&mut conn)
                .await
                .map_err(redis_error("Redis release failed"))?;
            Ok(())
        }
    }
}
