//! The statements of the PostgreSQL store and of the transactional mode,
//! the literals of the statements sent as text, and the migration.

use std::time::Duration;

use sqlx::postgres::{PgPool, PgRow};
use sqlx::{Executor, Row};

use crate::store::{Begin, Fingerprint, StoreError, StoredResponse};

/// The statements, made once for the table.
pub(crate) struct Sql {
    pub(crate) table: String,
    pub(crate) begin: String,
    pub(crate) select: String,
    pub(crate) renew: String,
    pub(crate) complete: String,
    pub(crate) release: String,
    /// The transactional mode's record: the claimed row, made final in
    /// the same transaction. Its indexed columns (the key, `expires_at`,
    /// set at the claim) do not change, so PostgreSQL can update it in
    /// place (a HOT update, no new index entries).
    pub(crate) record: String,
    /// The function that writes the same record in the COMMIT's round
    /// trip ([`record_function_sql`]): `<table>_record`, in the table's
    /// schema.
    pub(crate) record_fn: String,
}

impl Sql {
    pub(crate) fn new(t: &str) -> Self {
        Self {
            table: t.to_owned(),
            begin: format!(
                "INSERT INTO {t} AS r (scope, key, fingerprint, token, done, expires_at, response)
                 VALUES ($1, $2, $3, $4, false, clock_timestamp() + $5::bigint * interval '1 millisecond', NULL)
                 ON CONFLICT (scope, key) DO UPDATE
                   SET fingerprint = EXCLUDED.fingerprint, token = EXCLUDED.token, done = false,
                       expires_at = EXCLUDED.expires_at, response = NULL
                   WHERE r.expires_at <= clock_timestamp()
                 RETURNING 1"
            ),
            select: format!(
                "SELECT fingerprint, done, response FROM {t}
                 WHERE scope = $1 AND key = $2 AND expires_at > clock_timestamp()"
            ),
            // A renewal or completion whose row is gone (purged after it
            // expired unrenewed) writes it anew; one whose row is another
            // holder's writes nothing and returns no row. A finished row
            // keeps its token, so a holder's `complete` again (its first
            // answer was lost) finds its own row, and so does its renewal
            // (which then changes nothing, and returns `done`).
            renew: format!(
                "INSERT INTO {t} AS r (scope, key, fingerprint, token, done, expires_at, response)
                 VALUES ($1, $2, $3, $4, false, clock_timestamp() + $5::bigint * interval '1 millisecond', NULL)
                 ON CONFLICT (scope, key) DO UPDATE
                   SET expires_at = CASE WHEN r.done THEN r.expires_at ELSE EXCLUDED.expires_at END
                   WHERE r.token = EXCLUDED.token
                 RETURNING r.done"
            ),
            complete: format!(
                "INSERT INTO {t} AS r (scope, key, fingerprint, token, done, expires_at, response)
                 VALUES ($1, $2, $3, $4, true, clock_timestamp() + $5::bigint * interval '1 millisecond', $6)
                 ON CONFLICT (scope, key) DO UPDATE
                   SET done = true, response = EXCLUDED.response, expires_at = EXCLUDED.expires_at
                   WHERE r.token = EXCLUDED.token
                 RETURNING 1"
            ),
            release: format!(
                "DELETE FROM {t} WHERE scope = $1 AND key = $2 AND token = $3 AND NOT done"
            ),
            record: format!(
                "UPDATE {t} SET done = true, response = $4
                 WHERE scope = $1 AND key = $2 AND token = $3"
            ),
            record_fn: record_fn_name(t),
        }
    }
}

/// The transactional mode's statements sent as one simple query, which
/// binds no parameters: each value goes in as a literal ([`push_text`],
/// [`push_bytes`], numbers as Rust writes them, the table as validated).
impl Sql {
    /// The claim, then BEGIN: a plain INSERT of the key (no `ON CONFLICT`:
    /// it succeeds only if the key is new, so success proves it is ours),
    /// then `BEGIN`, in one round trip. The INSERT runs first, in the
    /// query's implicit transaction, which the `BEGIN` turns into the
    /// transaction the handler goes on in; if the INSERT fails (a record,
    /// a live or an expired claim: any conflict), the rest is skipped and
    /// the implicit transaction rolls back, so the connection is left out
    /// of any transaction. (`BEGIN` first would leave it in an aborted one,
    /// which `Pool::begin_with` would hand back to the pool as it is.)
    /// `None` when a value cannot be written as a literal (a NUL).
    pub(crate) fn claim_then_begin(
        &self,
        scope: &str,
        key: &str,
        fingerprint: &Fingerprint,
        token: &str,
        ttl_ms: i64,
    ) -> Option<String> {
        let mut sql = String::with_capacity(256 + self.table.len() + scope.len() + key.len());
        sql.push_str("INSERT INTO ");
        sql.push_str(&self.table);
        sql.push_str(" (scope, key, fingerprint, token, done, expires_at, response) VALUES (");
        push_text(&mut sql, scope)?;
        sql.push_str(", ");
        push_text(&mut sql, key)?;
        sql.push_str(", ");
        push_bytes(&mut sql, &fingerprint.0);
        sql.push_str(", ");
        push_text(&mut sql, token)?;
        sql.push_str(", false, clock_timestamp() + ");
        sql.push_str(&ttl_ms.to_string());
        sql.push_str("::bigint * interval '1 millisecond', NULL); BEGIN");
        Some(sql)
    }

    /// The record, then COMMIT, in one round trip: the claimed row made
    /// final by the table's record function ([`record_function_sql`]),
    /// which fails unless it updated the claimed row (the claim's key and
    /// token), then `COMMIT`, then `BEGIN`. A failed statement skips the
    /// rest of the query, so the COMMIT runs only after the record is
    /// written. The `BEGIN` leaves the connection in an empty transaction,
    /// as sqlx's `Transaction` believes it to be: the ROLLBACK it queues
    /// when dropped ends that one (with the connection's next round trip,
    /// the pool's check on release) and nothing else. `None` when a value
    /// cannot be written as a literal (a NUL).
    pub(crate) fn record_then_commit(
        &self,
        scope: &str,
        key: &str,
        token: &str,
        response: &[u8],
    ) -> Option<String> {
        let mut sql = String::with_capacity(
            64 + self.record_fn.len() + scope.len() + key.len() + token.len() + 2 * response.len(),
        );
        sql.push_str("SELECT ");
        sql.push_str(&self.record_fn);
        sql.push('(');
        push_text(&mut sql, scope)?;
        sql.push_str(", ");
        push_text(&mut sql, key)?;
        sql.push_str(", ");
        push_text(&mut sql, token)?;
        sql.push_str(", ");
        push_bytes(&mut sql, response);
        sql.push_str("); COMMIT; BEGIN");
        Some(sql)
    }

    /// The record function's signature, as `to_regprocedure` reads it.
    pub(crate) fn record_fn_signature(&self) -> String {
        format!("{}(text, text, text, bytea)", self.record_fn)
    }
}

/// What the record function fails with when the claimed row is not
/// there: its message, with SQLSTATE [`ROW_GONE_CODE`].
pub(crate) const ROW_GONE: &str = "resend: the claimed row is gone";

/// The SQLSTATE of [`ROW_GONE`]: `no_data_found`.
pub(crate) const ROW_GONE_CODE: &str = "P0002";

/// Writes `s` as a string literal that PostgreSQL reads back as `s`:
/// `E'...'`, with every `\` and every `'` doubled. In an `E''` string a
/// backslash is always an escape, whatever `standard_conforming_strings`
/// says, and a doubled one stands for itself, as a doubled quote does; no
/// other character means anything there, and the connection's encoding is
/// UTF-8 (sqlx sets it), in which no byte of a multi-byte character is a
/// `\` or a `'`. So the literal ends at its last quote, wherever the input
/// came from. `None`, and nothing written, for a string with a NUL, which
/// no PostgreSQL text can hold (a bound parameter is refused alike).
pub(crate) fn push_text(out: &mut String, s: &str) -> Option<()> {
    if s.contains('\0') {
        return None;
    }
    out.reserve(s.len() + 3);
    out.push_str("E'");
    let mut rest = s;
    while let Some(at) = rest.find(['\\', '\'']) {
        let (plain, special) = rest.split_at(at);
        out.push_str(plain);
        // Both are one byte long.
        let c = &special[..1];
        out.push_str(c);
        out.push_str(c);
        rest = &special[1..];
    }
    out.push_str(rest);
    out.push('\'');
    Some(())
}

/// Writes `bytes` as a `bytea` expression: `decode('<hex>', 'hex')`, the
/// hex digits lower case.
pub(crate) fn push_bytes(out: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.reserve(2 * bytes.len() + 17);
    out.push_str("decode('");
    for b in bytes {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    out.push_str("', 'hex')");
}

/// A database error as a store error saying `what` failed; a missing
/// table (SQLSTATE 42P01, `undefined_table`) or function (42883) says the
/// store is not set up: `migrate` was not run.
pub(crate) fn pg_error(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |e| {
        match &e {
        sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("42P01" | "42883")) => {
            StoreError::not_set_up(format!(
                "{what}: the idempotency table (or its function) does not exist: run `migrate()`, or apply `migration_sql()` in your migrations ({})",
                db.message()
            ))
        }
        _ => StoreError::with_source(what, e),
    }
    }
}

/// True for an SQL identifier (letters, digits, `_`; optionally
/// `schema.table`), so that a table name can be written into statements.
pub(crate) fn valid_table(name: &str) -> bool {
    let ident = |s: &str| {
        !s.is_empty()
            && s.len() <= 63
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && !s.as_bytes()[0].is_ascii_digit()
    };
    match name.split_once('.') {
        Some((schema, table)) => ident(schema) && ident(table),
        None => ident(name),
    }
}

/// The purge index of `table`: its name, and its name as `to_regclass`
/// finds it (in the table's schema).
fn index_name(table: &str) -> (String, String) {
    let bare = format!("{}_expires_at", table.replace('.', "_"));
    let found = match table.split_once('.') {
        Some((schema, _)) => format!("{schema}.{bare}"),
        None => bare.clone(),
    };
    (bare, found)
}

/// The table's definition and its purge index, for `table`: two
/// statements, each `IF NOT EXISTS`, so it can run any number of times.
/// Pages are left a fifth empty (`fillfactor`), so that a lease made final
/// (in either mode) is rewritten in place, a HOT update without new index
/// entries.
pub(crate) fn migration_sql(table: &str) -> String {
    let (index, _) = index_name(table);
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (
    scope text NOT NULL,
    key text NOT NULL,
    fingerprint bytea NOT NULL,
    token text,
    done boolean NOT NULL DEFAULT false,
    expires_at timestamptz NOT NULL,
    response bytea,
    PRIMARY KEY (scope, key)
) WITH (fillfactor = 80);
CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at);
"
    )
}

/// The name of `table`'s record function: `<table>_record`, in the
/// table's schema.
fn record_fn_name(table: &str) -> String {
    format!("{table}_record")
}

/// The transactional mode's record function for `table`: the claimed row
/// made final (the same UPDATE as the bound record), or an error
/// ([`ROW_GONE`], SQLSTATE [`ROW_GONE_CODE`]) if it is not there. PL/pgSQL
/// keeps the UPDATE's plan for the session, so a call is not planned anew
/// as a statement sent as text is. `CREATE OR REPLACE`: it can run any
/// number of times.
pub(crate) fn record_function_sql(table: &str) -> String {
    let name = record_fn_name(table);
    format!(
        "CREATE OR REPLACE FUNCTION {name}(p_scope text, p_key text, p_token text, p_response bytea)
RETURNS void LANGUAGE plpgsql AS $${}$$;
",
        record_function_body(table)
    )
}

/// The record function's body, as `pg_proc.prosrc` keeps it.
fn record_function_body(table: &str) -> String {
    format!(
        "
BEGIN
    UPDATE {table} SET done = true, response = p_response
    WHERE scope = p_scope AND key = p_key AND token = p_token;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '{ROW_GONE_CODE}', MESSAGE = '{ROW_GONE}';
    END IF;
END
"
    )
}

/// Runs [`migration_sql`] on `pool` (and, for the transactional mode,
/// [`record_function_sql`]), unless what it makes is there already. Safe to
/// run from several processes at once, and while the table is in use: the
/// catalog is read first, so a migration finds the schema in place without
/// a lock that row writes would wait on (`CREATE INDEX IF NOT EXISTS` takes
/// a SHARE lock on the table before it looks, and so waits for every open
/// transaction that wrote to it).
pub(crate) async fn migrate(
    pool: &PgPool,
    table: &str,
    transactional: bool,
) -> Result<(), StoreError> {
    if made(pool, table, transactional).await {
        return Ok(());
    }
    let mut sql = migration_sql(table);
    if transactional {
        sql.push_str(&record_function_sql(table));
    }
    match pool.execute(sqlx::raw_sql(&sql)).await {
        Ok(_) => Ok(()),
        // Two processes creating the table (or replacing the function) at
        // once: one of them loses the race on the catalog, and what it
        // made is there all the same.
        Err(_) if made(pool, table, transactional).await => Ok(()),
        Err(e) => Err(StoreError::with_source("migration failed", e)),
    }
}

/// Whether the table, its index and (for the transactional mode) the
/// record function, as this version makes it, are all there: read from
/// the catalog, with no lock on the table.
async fn made(pool: &PgPool, table: &str, transactional: bool) -> bool {
    let there = |check: &'static str, name: String| async move {
        sqlx::query_scalar::<_, bool>(check)
            .bind(name)
            .fetch_one(pool)
            .await
            .unwrap_or(false)
    };
    const CLASS: &str = "SELECT to_regclass($1) IS NOT NULL";
    // The function as this version writes it: its body compared, so an
    // older one is replaced.
    const FUNCTION: &str =
        "SELECT coalesce((SELECT prosrc FROM pg_proc WHERE oid = to_regprocedure($1)), '') = $2";
    let function_made = || async {
        sqlx::query_scalar::<_, bool>(FUNCTION)
            .bind(Sql::new(table).record_fn_signature())
            .bind(record_function_body(table))
            .fetch_one(pool)
            .await
            .unwrap_or(false)
    };
    there(CLASS, table.to_owned()).await
        && there(CLASS, index_name(table).1).await
        && (!transactional || function_made().await)
}

pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// What a `begin` that did not insert finds: the live row's state, or
/// `None` when it vanished meanwhile.
pub(crate) fn found(row: Option<PgRow>) -> Result<Option<Begin>, StoreError> {
    let Some(row) = row else { return Ok(None) };
    let bad = |e: sqlx::Error| StoreError::with_source("unreadable record in PostgreSQL", e);
    let fp: Vec<u8> = row.try_get(0).map_err(bad)?;
    let fingerprint = Fingerprint(
        fp.try_into()
            .map_err(|_| StoreError::new("unreadable record in PostgreSQL: fingerprint"))?,
    );
    let done: bool = row.try_get(1).map_err(bad)?;
    if !done {
        return Ok(Some(Begin::InProgress { fingerprint }));
    }
    let bytes: Vec<u8> = row.try_get(2).map_err(bad)?;
    let response = StoredResponse::decode(&bytes)
        .ok_or_else(|| StoreError::new("unreadable record in PostgreSQL: response"))?;
    Ok(Some(Begin::Completed {
        fingerprint,
        response: Box::new(response),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_identifiers() {
        assert!(valid_table("resend_idempotency"));
        assert!(valid_table("app.idem_2"));
        for bad in ["", "1abc", "a;drop table x", "a b", "a.b.c", "\"x\""] {
            assert!(!valid_table(bad), "{bad}");
        }
    }

    /// Reads an `E''` literal at the start of `sql` as PostgreSQL's lexer
    /// does, and returns its text and what follows it. An escape other than
    /// `\\` fails the test: `push_text` writes no other.
    fn read_literal(sql: &str) -> (String, &str) {
        let body = sql.strip_prefix("E'").expect("an E'' literal");
        let mut text = String::new();
        let mut chars = body.char_indices().peekable();
        while let Some((at, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, '\\')) => text.push('\\'),
                    other => panic!("an escape push_text does not write: {other:?} in {sql:?}"),
                },
                // A doubled quote stands for one; a lone one ends the literal.
                '\'' => match chars.peek() {
                    Some((_, '\'')) => {
                        chars.next();
                        text.push('\'');
                    }
                    _ => return (text, &body[at + 1..]),
                },
                c => text.push(c),
            }
        }
        panic!("the literal does not end: {sql:?}");
    }

    fn literal(s: &str) -> String {
        let mut sql = String::new();
        push_text(&mut sql, s).expect("no NUL");
        sql
    }

    /// Hostile strings come back as they went in, and the literal ends where
    /// it should: what follows is never read as part of it.
    #[test]
    fn text_literals_cannot_break_out() {
        let hostile = [
            "",
            "'",
            "\\",
            "\\'",
            "'\\",
            "''",
            "\\\\'",
            "'; DROP TABLE x; --",
            "\\'; DROP TABLE x; --",
            "x' OR '1'='1",
            "$$; DROP TABLE x; $$",
            "E'\\x27'",
            "\\x27\\047\\u0027",
            "line\nbreak\r\ttab",
            "naïve – 日本語 😀 \u{a0}\u{2028}",
            "cred:0123abcd",
        ];
        for s in hostile {
            let sql = format!("{} AND evil", literal(s));
            assert_eq!(read_literal(&sql), (s.to_owned(), " AND evil"), "{s:?}");
        }
        assert_eq!(literal("'; DROP TABLE x; --"), "E'''; DROP TABLE x; --'");
        assert_eq!(literal("a\\'b"), "E'a\\\\''b'");
        // And any mix of what matters, from a seeded generator.
        let alphabet = [
            '\'', '\\', ';', '-', ' ', 'a', 'E', '$', '"', '\n', 'é', '€', '😀',
        ];
        let mut rng = fastrand::Rng::with_seed(13);
        for _ in 0..5000 {
            let s: String = (0..rng.usize(0..24))
                .map(|_| alphabet[rng.usize(..alphabet.len())])
                .collect();
            let sql = format!("{})", literal(&s));
            assert_eq!(read_literal(&sql), (s.clone(), ")"), "{s:?}");
        }
    }

    #[test]
    fn a_nul_is_refused_and_nothing_is_written() {
        let mut sql = String::from("x");
        assert_eq!(push_text(&mut sql, "a\0b"), None);
        assert_eq!(sql, "x");
        let sql = Sql::new("t");
        let fp = Fingerprint([0; 32]);
        assert!(sql.claim_then_begin("s\0", "k", &fp, "t", 1).is_none());
        assert!(sql.record_then_commit("s", "k\0", "t", b"").is_none());
    }

    #[test]
    fn bytes_are_hex_in_decode() {
        let mut sql = String::new();
        push_bytes(&mut sql, &[0x00, 0x27, 0x5c, 0xff]);
        assert_eq!(sql, "decode('00275cff', 'hex')");
    }

    #[test]
    fn the_one_round_trip_statements() {
        let sql = Sql::new("app.idem");
        let fp = Fingerprint([0xab; 32]);
        let claim = sql
            .claim_then_begin("cred:'x", "k\\1", &fp, "00ff", 86_400_000)
            .unwrap();
        assert_eq!(
            claim,
            format!(
                "INSERT INTO app.idem (scope, key, fingerprint, token, done, expires_at, response) \
                 VALUES (E'cred:''x', E'k\\\\1', decode('{}', 'hex'), E'00ff', false, \
                 clock_timestamp() + 86400000::bigint * interval '1 millisecond', NULL); BEGIN",
                "ab".repeat(32)
            )
        );
        assert!(
            !claim.contains("ON CONFLICT"),
            "success proves the key is new"
        );
        let record = sql.record_then_commit("s", "k'", "t\\", b"\x01'").unwrap();
        assert_eq!(
            record,
            "SELECT app.idem_record(E's', E'k''', E't\\\\', decode('0127', 'hex')); COMMIT; BEGIN"
        );
        assert_eq!(
            sql.record_fn_signature(),
            "app.idem_record(text, text, text, bytea)"
        );
    }

    #[test]
    fn the_migration_makes_the_table_and_its_purge_index() {
        let sql = migration_sql("app.idem");
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS app.idem ("));
        assert!(sql.contains("PRIMARY KEY (scope, key)"));
        assert!(
            sql.contains("CREATE INDEX IF NOT EXISTS app_idem_expires_at ON app.idem (expires_at)")
        );
    }

    #[test]
    fn the_record_function_updates_the_claim_or_fails() {
        let sql = record_function_sql("app.idem");
        assert!(sql.starts_with(
            "CREATE OR REPLACE FUNCTION app.idem_record(p_scope text, p_key text, p_token text, p_response bytea)"
        ));
        assert!(sql.contains(
            "UPDATE app.idem SET done = true, response = p_response\n    WHERE scope = p_scope AND key = p_key AND token = p_token;"
        ));
        assert!(sql.contains(
            "IF NOT FOUND THEN\n        RAISE EXCEPTION USING ERRCODE = 'P0002', MESSAGE = 'resend: the claimed row is gone';"
        ));
    }
}
