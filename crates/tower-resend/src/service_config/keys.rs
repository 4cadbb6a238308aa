//! The keys of the config's objects matched to fields as the big
//! implementations match them, one rule for every field: grpc-go decodes
//! with Go's `encoding/json`, which matches a key to a field whatever its
//! case (`"MaxAttempts"`, as grpc-go's own retry example writes it), and
//! proto3's JSON mapping has parsers accept a field's proto name
//! (`max_attempts`) beside its JSON name (`maxAttempts`).
//!
//! Two keys of one object that name the same field are an error naming
//! both (grpc-go keeps the last, which hides one of them). A key that names
//! no field is ignored, as gRPC ignores it, and listed once a document at
//! debug level with `tracing`.

use serde_json::Value;

use super::InvalidConfig;

type Result<T> = std::result::Result<T, InvalidConfig>;

/// Whether the JSON key `key` names the field whose JSON name
/// (lowerCamelCase, as `maxAttempts`) is `name`: `key` is that name or the
/// field's proto name (`max_attempts`, the JSON name with `_` before each
/// capital), ignoring case as Go's `encoding/json` ignores it.
pub(crate) fn names(key: &str, name: &str) -> bool {
    let snake = name.chars().flat_map(|c| {
        let underscore = c.is_ascii_uppercase().then_some('_');
        underscore.into_iter().chain(std::iter::once(c))
    });
    key.chars().map(fold).eq(name.chars().map(fold)) || key.chars().map(fold).eq(snake.map(fold))
}

/// A character as Go's `encoding/json` compares keys: by Unicode simple
/// case folding, under which the two characters outside ASCII that fold
/// to an ASCII letter are the long s (`ſ`, as `s`) and the Kelvin sign
/// (`K`, as `k`). The names here are ASCII, so these are all that can
/// match.
fn fold(c: char) -> char {
    match c {
        '\u{17F}' => 'S',
        '\u{212A}' => 'K',
        c => c.to_ascii_uppercase(),
    }
}

/// `path.key`, or `key` at the top.
pub(crate) fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

/// Reads the objects of one document, field by field, and keeps the paths
/// of the keys it did not read, to say once what was ignored.
#[derive(Debug, Default)]
pub(crate) struct Reader {
    /// Keys that name no field gRPC defines, as written.
    unknown: Vec<String>,
    /// Fields gRPC defines that a stack does not apply (`waitForReady`).
    not_applied: Vec<String>,
}

impl Reader {
    /// The `fields` (by JSON name) of the object `v` at `path`, in that
    /// order, each found by [`names`]; `not_applied`: the fields gRPC
    /// defines there that are not read.
    pub(crate) fn object<'a, const N: usize>(
        &mut self,
        v: &'a Value,
        path: &str,
        fields: [&'static str; N],
        not_applied: &[&'static str],
    ) -> Result<[Field<'a>; N]> {
        let map = v
            .as_object()
            .ok_or_else(|| InvalidConfig::value(path, v, "is not an object"))?;
        let known = || fields.iter().chain(not_applied);
        // The key that named each known field, and its value.
        let mut found: Vec<Option<(&'a str, &'a Value)>> = vec![None; N + not_applied.len()];
        let mut unknown_here = Vec::new();
        for (key, value) in map {
            let Some(i) = known().position(|name| names(key, name)) else {
                self.unknown.push(join(path, key));
                unknown_here.push(key.as_str());
                continue;
            };
            if let Some((first, _)) = found[i] {
                let name = known().nth(i).copied().unwrap_or_default();
                let (a, b) = if first < key.as_str() {
                    (first, key.as_str())
                } else {
                    (key.as_str(), first)
                };
                return Err(InvalidConfig::new(
                    join(path, name),
                    format!("is set twice, as {a:?} and {b:?}: keep one"),
                ));
            }
            found[i] = Some((key, value));
            if i >= N {
                self.not_applied.push(join(path, key));
            }
        }
        let hint = (!unknown_here.is_empty()).then(|| {
            // A few: an object of a thousand strange keys needs no list.
            const SHOWN: usize = 5;
            let mut keys: Vec<String> = unknown_here
                .iter()
                .take(SHOWN)
                .map(|k| format!("{k:?}"))
                .collect();
            if unknown_here.len() > SHOWN {
                keys.push(format!("and {} more", unknown_here.len() - SHOWN));
            }
            format!(" (the keys here that name no field: {})", keys.join(", "))
        });
        Ok(std::array::from_fn(|i| match found[i] {
            Some((key, value)) => Field {
                path: join(path, key),
                value: Some(value).filter(|v| !v.is_null()),
                hint: None,
            },
            None => Field {
                path: join(path, fields[i]),
                value: None,
                hint: hint.clone(),
            },
        }))
    }

    /// The keys that named no field, by path.
    #[cfg(test)]
    pub(crate) fn unknown(&self) -> &[String] {
        &self.unknown
    }

    /// The fields gRPC defines that were not applied, by path.
    #[cfg(test)]
    pub(crate) fn not_applied(&self) -> &[String] {
        &self.not_applied
    }

    /// Says, in one event at debug level, what `what` (`"service
    /// config"`) had that was not read, by path.
    pub(crate) fn log(&self, what: &str) {
        if self.unknown.is_empty() && self.not_applied.is_empty() {
            return;
        }
        tracing::debug!(
            unknown = ?self.unknown,
            not_applied = ?self.not_applied,
            "{what}: fields not read: unknown ones, ignored as gRPC ignores them, \
             and gRPC settings that tower-resend does not apply"
        );
    }
}

/// A field of an object: its path (by the key as written, or by its JSON
/// name when absent) and its value, `null` read as absent (proto JSON's
/// default).
#[derive(Debug)]
pub(crate) struct Field<'a> {
    path: String,
    value: Option<&'a Value>,
    /// For an absent field: the object's keys that named nothing, which
    /// may be it misspelt.
    hint: Option<String>,
}

impl<'a> Field<'a> {
    /// Where it is.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// The value, if there is one.
    pub(crate) fn value(&self) -> Option<&'a Value> {
        self.value
    }

    /// The value read by `read` (given the path), if there is one.
    pub(crate) fn read<T>(
        &self,
        read: impl FnOnce(&'a Value, &str) -> Result<T>,
    ) -> Result<Option<T>> {
        self.value.map(|v| read(v, &self.path)).transpose()
    }

    /// The value read by `read`; an error if there is none.
    pub(crate) fn require<T>(&self, read: impl FnOnce(&'a Value, &str) -> Result<T>) -> Result<T> {
        match self.value {
            Some(v) => read(v, &self.path),
            None => Err(InvalidConfig::new(
                &*self.path,
                format!("is required{}", self.hint.as_deref().unwrap_or_default()),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Map;

    use super::*;
    use crate::test_events::Events;

    #[test]
    fn keys_name_fields_as_grpc_go_and_proto_json_match_them() {
        for key in [
            "maxAttempts",
            "MaxAttempts",
            "MAXATTEMPTS",
            "maxattempts",
            "max_attempts",
            "MAX_ATTEMPTS",
            "Max_Attempts",
            // Go's simple folding: the long s and the Kelvin sign.
            "maxAttemptſ",
        ] {
            assert!(names(key, "maxAttempts"), "{key}");
        }
        assert!(names("\u{212A}ey", "key"));
        for key in [
            "maxAttempt",
            "max_attempt",
            "maxAttemptsX",
            "max__attempts",
            "_max_attempts",
            "maxatt_empts",
            "max-attempts",
            "max attempts",
            " maxAttempts",
            "",
        ] {
            assert!(!names(key, "maxAttempts"), "{key}");
        }
        assert!(names("per_attempt_recv_timeout", "perAttemptRecvTimeout"));
        assert!(names("Service", "service"));
    }

    #[test]
    fn an_object_is_read_by_field_with_what_it_ignored() {
        let v: Value = serde_json::from_str(
            r#"{"Timeout": "1s", "wait_for_ready": true, "retry_polcy": {}, "name": null}"#,
        )
        .unwrap();
        let mut reader = Reader::default();
        let [name, timeout, retry] = reader
            .object(
                &v,
                "m[0]",
                ["name", "timeout", "retryPolicy"],
                &["waitForReady"],
            )
            .unwrap();
        assert_eq!(timeout.path(), "m[0].Timeout");
        assert_eq!(timeout.value(), Some(&Value::from("1s")));
        // Null is as absent; an absent field is named by its JSON name.
        assert_eq!((name.path(), name.value()), ("m[0].name", None));
        assert_eq!(retry.path(), "m[0].retryPolicy");
        let err = retry.require(|_, _| Ok(())).unwrap_err();
        assert_eq!(
            err.to_string(),
            "m[0].retryPolicy: is required (the keys here that name no field: \"retry_polcy\")"
        );
        assert_eq!(reader.unknown(), ["m[0].retry_polcy"]);
        assert_eq!(reader.not_applied(), ["m[0].wait_for_ready"]);
        let events = Events::under(module_path!().trim_end_matches("::tests"));
        let _second = Events::keep_callsites_open();
        tracing::subscriber::with_default(events.clone(), || {
            reader.log("service config");
            Reader::default().log("nothing ignored");
        });
        let got = events.got();
        assert_eq!(got.len(), 1, "{got:?}");
        let (level, message, fields) = &got[0];
        assert_eq!(*level, tracing::Level::DEBUG);
        assert!(
            message.starts_with("service config: fields not read"),
            "{message}"
        );
        assert_eq!(
            fields,
            &[
                ("unknown".to_owned(), r#"["m[0].retry_polcy"]"#.to_owned()),
                (
                    "not_applied".to_owned(),
                    r#"["m[0].wait_for_ready"]"#.to_owned()
                ),
            ]
        );

        // Of many keys that name nothing, a few are shown.
        let many: Map<String, Value> = (0..8).map(|i| (format!("k{i}"), Value::Null)).collect();
        let many = Value::Object(many);
        let [absent] = Reader::default()
            .object(&many, "p", ["maxAttempts"], &[])
            .unwrap();
        assert_eq!(
            absent.require(|_, _| Ok(())).unwrap_err().message(),
            "is required (the keys here that name no field: \"k0\", \"k1\", \"k2\", \"k3\", \"k4\", and 3 more)"
        );

        // Two keys for one field, applied or not: an error naming both.
        for (json, path, message) in [
            (
                r#"{"max_attempts": 2, "MaxAttempts": 4}"#,
                "p.maxAttempts",
                r#"is set twice, as "MaxAttempts" and "max_attempts": keep one"#,
            ),
            (
                r#"{"waitForReady": true, "wait_for_ready": false}"#,
                "p.waitForReady",
                r#"is set twice, as "waitForReady" and "wait_for_ready": keep one"#,
            ),
        ] {
            let v: Value = serde_json::from_str(json).unwrap();
            let err = Reader::default()
                .object(&v, "p", ["maxAttempts"], &["waitForReady"])
                .unwrap_err();
            assert_eq!((err.path(), err.message()), (path, message), "{json}");
        }
    }
}
