//! Reading each form of quota fields off an answer: the field names of
//! each form, made once, and the parsing of their values (structured
//! fields, counts, resets as delta seconds, epoch times, durations and
//! RFC 3339 times), each value bounded as [`QuotaReader`] says.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::header::RETRY_AFTER;
use http::{HeaderMap, HeaderName, StatusCode};
use sfv::{BareItem, Dictionary, List, ListEntry, Parameters, Parser};

use super::clock::{go_duration, rfc3339};
use super::read::{Doubt, Doubted, Form, Quota, QuotaReader, Reading, EPOCH_FROM};
use crate::classify::parse_retry_after;

impl QuotaReader {
    /// What `headers` (of an answer of `status`, at `now`) say of the
    /// caller's quotas: every form, the table in the [module docs](super).
    pub fn read(&self, status: StatusCode, headers: &HeaderMap, now: SystemTime) -> Reading {
        let mut r = Read {
            reader: self,
            headers,
            now,
            out: Reading::default(),
        };
        r.ietf();
        r.triple(Form::Draft, "default", &TRIPLES[0]);
        r.triple(Form::XRateLimit, "default", &TRIPLES[1]);
        r.triple(Form::XRateDashLimit, "default", &TRIPLES[2]);
        for (resource, names) in &MODEL_DURATIONS {
            r.fields(Form::ModelDuration, resource, names, Reset::Duration);
        }
        for (resource, names) in &MODEL_TIMES {
            r.fields(Form::ModelTime, resource, names, Reset::Time);
        }
        for c in &self.custom {
            r.fields(Form::Custom, &c.policy, &c.names, Reset::Seconds);
        }
        if matches!(
            status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::FORBIDDEN
        ) {
            r.retry_after();
        }
        r.out
    }
}

/// Three field names, made once: limit, remaining, reset.
const fn names(
    limit: &'static str,
    remaining: &'static str,
    reset: &'static str,
) -> [HeaderName; 3] {
    [
        HeaderName::from_static(limit),
        HeaderName::from_static(remaining),
        HeaderName::from_static(reset),
    ]
}

/// The three-field forms: limit, remaining, reset.
const TRIPLES: [[HeaderName; 3]; 3] = [
    names("ratelimit-limit", "ratelimit-remaining", "ratelimit-reset"),
    names(
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
    ),
    names(
        "x-rate-limit-limit",
        "x-rate-limit-remaining",
        "x-rate-limit-reset",
    ),
];

/// The model APIs' fields with a reset as a duration, by resource.
const MODEL_DURATIONS: [(&str, [HeaderName; 3]); 2] = [
    (
        "requests",
        names(
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
        ),
    ),
    (
        "tokens",
        names(
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
        ),
    ),
];

/// The model APIs' fields with a reset as an RFC 3339 time, by resource.
const MODEL_TIMES: [(&str, [HeaderName; 3]); 4] = [
    (
        "requests",
        names(
            "anthropic-ratelimit-requests-limit",
            "anthropic-ratelimit-requests-remaining",
            "anthropic-ratelimit-requests-reset",
        ),
    ),
    (
        "tokens",
        names(
            "anthropic-ratelimit-tokens-limit",
            "anthropic-ratelimit-tokens-remaining",
            "anthropic-ratelimit-tokens-reset",
        ),
    ),
    (
        "input-tokens",
        names(
            "anthropic-ratelimit-input-tokens-limit",
            "anthropic-ratelimit-input-tokens-remaining",
            "anthropic-ratelimit-input-tokens-reset",
        ),
    ),
    (
        "output-tokens",
        names(
            "anthropic-ratelimit-output-tokens-limit",
            "anthropic-ratelimit-output-tokens-remaining",
            "anthropic-ratelimit-output-tokens-reset",
        ),
    ),
];

/// How a reset is written.
#[derive(Clone, Copy)]
enum Reset {
    /// Delta seconds only.
    Delta,
    /// Delta seconds, or an epoch time in seconds.
    Seconds,
    /// A Go duration.
    Duration,
    /// An RFC 3339 time.
    Time,
}

/// One reading under way.
struct Read<'a> {
    reader: &'a QuotaReader,
    headers: &'a HeaderMap,
    now: SystemTime,
    out: Reading,
}

impl Read<'_> {
    fn doubt(&mut self, field: &HeaderName, doubt: Doubt) {
        self.out.doubted.push(Doubted {
            field: field.clone(),
            doubt,
        });
    }

    /// `d`, at most the cap (doubted past it).
    fn capped(&mut self, field: &HeaderName, d: Duration) -> Duration {
        if d > self.reader.cap {
            self.doubt(field, Doubt::PastCap);
            return self.reader.cap;
        }
        d
    }

    /// The field's lines joined as one structured field value.
    fn joined(&self, name: &HeaderName) -> Option<String> {
        let mut lines = self.headers.get_all(name).iter().peekable();
        lines.peek()?;
        let mut joined = String::new();
        for (i, v) in lines.enumerate() {
            if i > 0 {
                joined.push_str(", ");
            }
            joined.push_str(&String::from_utf8_lossy(v.as_bytes()));
        }
        Some(joined)
    }

    /// The IETF fields (a list of policies), or an earlier draft's one
    /// `RateLimit` dictionary.
    fn ietf(&mut self) {
        const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
        const POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
        let Some(value) = self.joined(&RATELIMIT) else {
            return;
        };
        let policies: List = match self.joined(&POLICY).map(|p| Parser::new(&p).parse()) {
            Some(Ok(list)) => list,
            Some(Err(_)) => {
                self.doubt(&POLICY, Doubt::Malformed);
                List::new()
            }
            None => List::new(),
        };
        match Parser::new(&value).parse::<List>() {
            Ok(list)
                if list.iter().any(
                    |e| matches!(e, ListEntry::Item(i) if param(&i.params, "r").is_some()),
                ) =>
            {
                for entry in list {
                    self.ietf_entry(&RATELIMIT, entry, &policies);
                }
            }
            _ => match Parser::new(&value).parse::<Dictionary>() {
                Ok(dict) if dict.contains_key("remaining") => {
                    self.draft_dictionary(&RATELIMIT, &dict)
                }
                _ => self.doubt(&RATELIMIT, Doubt::Malformed),
            },
        }
    }

    fn ietf_entry(&mut self, field: &HeaderName, entry: ListEntry, policies: &List) {
        let ListEntry::Item(item) = entry else {
            return self.doubt(field, Doubt::Malformed);
        };
        let Some(name) = identifier(&item.bare_item) else {
            return self.doubt(field, Doubt::Malformed);
        };
        let partition = param(&item.params, "pk").and_then(BareItem::as_byte_sequence);
        let policy = policies.iter().find_map(|p| match p {
            ListEntry::Item(p)
                if identifier(&p.bare_item) == Some(name)
                    && param(&p.params, "pk").and_then(BareItem::as_byte_sequence) == partition =>
            {
                Some(&p.params)
            }
            _ => None,
        });
        let limit = policy.and_then(|p| int(param(p, "q")));
        let window = policy
            .and_then(|p| int(param(p, "w")))
            .map(Duration::from_secs);
        let remaining = match param(&item.params, "r")
            .and_then(BareItem::as_integer)
            .map(i64::from)
        {
            Some(r) if r < 0 => return self.doubt(field, Doubt::Negative),
            Some(r) => r.unsigned_abs(),
            None => return self.doubt(field, Doubt::Malformed),
        };
        // No reset: the policy's window, if it has one.
        let reset = match param(&item.params, "t")
            .and_then(BareItem::as_integer)
            .map(i64::from)
        {
            Some(t) if t < 0 => return self.doubt(field, Doubt::Negative),
            Some(t) => Duration::from_secs(t.unsigned_abs()),
            None => match window {
                Some(w) => w,
                None => return self.doubt(field, Doubt::Malformed),
            },
        };
        let reset = self.capped(field, reset);
        self.out.quotas.push(Quota {
            form: Form::Ietf,
            policy: name.into(),
            partition: partition.map(Into::into),
            limit,
            remaining,
            reset,
            window,
        });
    }

    /// An earlier draft's `RateLimit: limit=10, remaining=5, reset=5`.
    fn draft_dictionary(&mut self, field: &HeaderName, dict: &Dictionary) {
        let member = |name: &str| match dict.get(name) {
            Some(ListEntry::Item(i)) => i.bare_item.as_integer().map(i64::from),
            _ => None,
        };
        let (Some(remaining), Some(reset)) = (member("remaining"), member("reset")) else {
            return self.doubt(field, Doubt::Malformed);
        };
        if remaining < 0 || reset < 0 {
            return self.doubt(field, Doubt::Negative);
        }
        let reset = self.capped(field, Duration::from_secs(reset.unsigned_abs()));
        self.out.quotas.push(Quota {
            form: Form::Draft,
            policy: "default".into(),
            partition: None,
            limit: member("limit").and_then(|l| u64::try_from(l).ok()),
            remaining: remaining.unsigned_abs(),
            reset,
            window: None,
        });
    }

    fn triple(&mut self, form: Form, policy: &str, names: &[HeaderName; 3]) {
        let how = if form == Form::Draft {
            Reset::Delta
        } else {
            Reset::Seconds
        };
        self.fields(form, policy, names, how);
    }

    /// A form of three fields: read when what remains is there.
    fn fields(
        &mut self,
        form: Form,
        policy: &str,
        [limit, remaining, reset]: &[HeaderName; 3],
        how: Reset,
    ) {
        let Some(left) = self.headers.get(remaining) else {
            return;
        };
        let Some(left) = self.count(remaining, left.as_bytes()) else {
            return;
        };
        let limit = match self.headers.get(limit) {
            Some(v) => self.count(limit, v.as_bytes()),
            None => None,
        };
        let Some(value) = self.headers.get(reset) else {
            return self.doubt(reset, Doubt::Malformed);
        };
        let Some(wait) = self.wait(reset, value.as_bytes(), how) else {
            return;
        };
        let wait = self.capped(reset, wait);
        self.out.quotas.push(Quota {
            form,
            policy: policy.into(),
            partition: None,
            limit,
            remaining: left,
            reset: wait,
            window: None,
        });
    }

    /// A count: the first integer of the value (an earlier draft's
    /// `RateLimit-Limit: 100, 100;w=60` names its quota first).
    fn count(&mut self, field: &HeaderName, value: &[u8]) -> Option<u64> {
        let text = std::str::from_utf8(value).ok().map(str::trim);
        let first = text.map(|t| t.split([',', ';']).next().unwrap_or("").trim());
        match first {
            Some(n) if n.starts_with('-') && n.len() > 1 => {
                self.doubt(field, Doubt::Negative);
                None
            }
            Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => match n.parse() {
                Ok(n) => Some(n),
                Err(_) => {
                    self.doubt(field, Doubt::Malformed);
                    None
                }
            },
            _ => {
                self.doubt(field, Doubt::Malformed);
                None
            }
        }
    }

    /// The wait a reset value says, written `how`.
    fn wait(&mut self, field: &HeaderName, value: &[u8], how: Reset) -> Option<Duration> {
        let text = std::str::from_utf8(value).ok().map(str::trim).unwrap_or("");
        let wait = match how {
            Reset::Delta | Reset::Seconds => {
                let secs = self.count(field, text.as_bytes())?;
                if matches!(how, Reset::Seconds) && secs >= EPOCH_FROM {
                    let at = UNIX_EPOCH + Duration::from_secs(secs);
                    Some(at.duration_since(self.now).unwrap_or(Duration::ZERO))
                } else {
                    Some(Duration::from_secs(secs))
                }
            }
            Reset::Duration => go_duration(text),
            Reset::Time => {
                rfc3339(text).map(|at| at.duration_since(self.now).unwrap_or(Duration::ZERO))
            }
        };
        if wait.is_none() && !matches!(how, Reset::Delta | Reset::Seconds) {
            let doubt = if text.starts_with('-') {
                Doubt::Negative
            } else {
                Doubt::Malformed
            };
            self.doubt(field, doubt);
        }
        wait
    }

    fn retry_after(&mut self) {
        let Some(value) = self.headers.get(RETRY_AFTER) else {
            return;
        };
        match parse_retry_after(value.as_bytes(), self.now) {
            Ok(wait) => self.out.retry_after = Some(self.capped(&RETRY_AFTER, wait)),
            Err(_) => {
                let doubt = if value.as_bytes().first() == Some(&b'-') {
                    Doubt::Negative
                } else {
                    Doubt::Malformed
                };
                self.doubt(&RETRY_AFTER, doubt);
            }
        }
    }
}

/// A policy's identifier: a String or a Token.
fn identifier(item: &BareItem) -> Option<&str> {
    item.as_string()
        .map(|s| s.as_str())
        .or_else(|| item.as_token().map(|t| t.as_str()))
}

/// The parameter `key`.
fn param<'a>(params: &'a Parameters, key: &str) -> Option<&'a BareItem> {
    params
        .iter()
        .find(|(k, _)| k.as_str() == key)
        .map(|(_, v)| v)
}

/// A non-negative integer parameter.
fn int(item: Option<&BareItem>) -> Option<u64> {
    item.and_then(BareItem::as_integer)
        .and_then(|i| u64::try_from(i64::from(i)).ok())
}
