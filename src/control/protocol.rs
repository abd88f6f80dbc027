//! The control protocol's messages: one JSON object per line each way (docs/CONTROL.md).
//!
//! Requests are parsed by hand from a `serde_json::Value` rather than with a derived
//! `Deserialize`, because the socket faces whatever a script sends and each mistake
//! deserves its own one-line message (derived untagged/flattened enums only say "did
//! not match any variant"). `Serialize`/`Deserialize` are still implemented, through
//! the same code, so `serde_json::to_string(&req)` and `from_str` work.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

/// Longest request line the daemon reads, without its newline.
pub const MAX_REQUEST_LINE: usize = 64 * 1024;
/// Longest error message sent in a reply (longer ones are cut).
pub const MAX_ERROR_LEN: usize = 1000;

/// Every verb, in the order error messages list them.
pub const VERBS: &[&str] = &[
    "ping",
    "stat",
    "prefetch",
    "pin",
    "unpin",
    "evict",
    "trace",
    "route",
    "materialize",
];

/// What a prefetch / pin / unpin / evict applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A virtual file, whole (`range: None`) or the half-open byte range `a..b`.
    File {
        file: String,
        range: Option<(u64, u64)>,
    },
    /// All rows of one tensor (canonical name).
    Tensor(String),
    /// Every tensor of one transformer block.
    Layer(u32),
}

/// One request from a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Ping,
    Stat,
    Prefetch(Target),
    Pin(Target),
    Unpin(Target),
    /// `None`: every unpinned chunk.
    Evict(Option<Target>),
    Trace {
        on: bool,
    },
    Route {
        prompt: String,
        top_k: Option<u32>,
        budget_bytes: Option<u64>,
        prefetch: bool,
        /// Virtual file whose chunks the route names (default `model.gguf`).
        file: Option<String>,
    },
    /// Reconstruct whole files into the disk tier in the background (progress in
    /// `stat`'s `tier.materialize`).
    Materialize {
        /// One virtual file; None: every tensor file.
        file: Option<String>,
    },
}

impl Request {
    /// The request's verb as it appears on the wire.
    pub fn verb(&self) -> &'static str {
        match self {
            Request::Ping => "ping",
            Request::Stat => "stat",
            Request::Prefetch(_) => "prefetch",
            Request::Pin(_) => "pin",
            Request::Unpin(_) => "unpin",
            Request::Evict(_) => "evict",
            Request::Trace { .. } => "trace",
            Request::Route { .. } => "route",
            Request::Materialize { .. } => "materialize",
        }
    }

    /// The wire form: `{"verb": ..., fields...}`.
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("verb".into(), self.verb().into());
        match self {
            Request::Ping | Request::Stat | Request::Evict(None) => {}
            Request::Prefetch(t)
            | Request::Pin(t)
            | Request::Unpin(t)
            | Request::Evict(Some(t)) => match t {
                Target::File { file, range } => {
                    m.insert("file".into(), file.clone().into());
                    if let Some((a, b)) = range {
                        m.insert("range".into(), Value::from(vec![*a, *b]));
                    }
                }
                Target::Tensor(name) => {
                    m.insert("tensor".into(), name.clone().into());
                }
                Target::Layer(n) => {
                    m.insert("layer".into(), (*n).into());
                }
            },
            Request::Trace { on } => {
                m.insert("on".into(), (*on).into());
            }
            Request::Materialize { file } => {
                if let Some(f) = file {
                    m.insert("file".into(), f.clone().into());
                }
            }
            Request::Route {
                prompt,
                top_k,
                budget_bytes,
                prefetch,
                file,
            } => {
                m.insert("prompt".into(), prompt.clone().into());
                if let Some(f) = file {
                    m.insert("file".into(), f.clone().into());
                }
                if let Some(k) = top_k {
                    m.insert("top_k".into(), (*k).into());
                }
                if let Some(b) = budget_bytes {
                    m.insert("budget_bytes".into(), (*b).into());
                }
                m.insert("prefetch".into(), (*prefetch).into());
            }
        }
        Value::Object(m)
    }

    /// Parses a request object; the error is one line naming the problem.
    pub fn from_json(v: &Value) -> Result<Request, String> {
        let obj = match v {
            Value::Object(m) => m,
            other => {
                return Err(format!(
                    "request must be a JSON object, got {}",
                    kind_of(other)
                ))
            }
        };
        let verb = match obj.get("verb") {
            None => return Err("missing field \"verb\"".into()),
            Some(Value::String(s)) => s.as_str(),
            Some(other) => {
                return Err(format!(
                    "field \"verb\" must be a string, got {}",
                    show(other)
                ))
            }
        };
        let allowed: &[&str] = match verb {
            "ping" | "stat" => &[],
            "prefetch" | "pin" | "unpin" | "evict" => &["file", "range", "tensor", "layer"],
            "trace" => &["on"],
            "route" => &["prompt", "top_k", "budget_bytes", "prefetch", "file"],
            "materialize" => &["file"],
            _ => {
                return Err(format!(
                    "unknown verb {} (expected one of: {})",
                    show(&Value::String(verb.to_string())),
                    VERBS.join(", ")
                ))
            }
        };
        if let Some(k) = obj
            .keys()
            .find(|k| *k != "verb" && !allowed.contains(&k.as_str()))
        {
            return Err(format!(
                "unknown field {} for verb \"{verb}\"",
                show(&Value::String(k.clone()))
            ));
        }
        let f = Fields { obj };
        Ok(match verb {
            "ping" => Request::Ping,
            "stat" => Request::Stat,
            "prefetch" => Request::Prefetch(f.target(verb)?.ok_or_else(|| need_selector(verb))?),
            "pin" => Request::Pin(f.target(verb)?.ok_or_else(|| need_selector(verb))?),
            "unpin" => Request::Unpin(f.target(verb)?.ok_or_else(|| need_selector(verb))?),
            "evict" => Request::Evict(f.target(verb)?),
            "trace" => Request::Trace {
                on: f.bool("on")?.ok_or("missing field \"on\"")?,
            },
            "route" => {
                let prompt = f.string("prompt")?.ok_or("missing field \"prompt\"")?;
                if prompt.is_empty() {
                    return Err("field \"prompt\" must not be empty".into());
                }
                let top_k = f.uint("top_k")?;
                let top_k = match top_k {
                    None => None,
                    Some(k) if k >= 1 && k <= u64::from(u32::MAX) => Some(k as u32),
                    Some(k) => {
                        return Err(format!(
                            "field \"top_k\" must be at least 1 and fit in 32 bits, got {k}"
                        ))
                    }
                };
                Request::Route {
                    prompt,
                    top_k,
                    budget_bytes: f.uint("budget_bytes")?,
                    prefetch: f.bool("prefetch")?.unwrap_or(false),
                    file: f.string("file")?,
                }
            }
            "materialize" => Request::Materialize {
                file: f.string("file")?,
            },
            _ => unreachable!("verb checked above"),
        })
    }

    /// Parses one request line (without its newline; a trailing `\r` is ignored).
    pub fn parse_line(line: &[u8]) -> Result<Request, String> {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let text =
            std::str::from_utf8(line).map_err(|_| "request is not valid UTF-8".to_string())?;
        if text.trim().is_empty() {
            return Err("empty request line".into());
        }
        let v: Value = serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))?;
        Request::from_json(&v)
    }
}

fn need_selector(verb: &str) -> String {
    format!("{verb} needs exactly one of \"file\", \"tensor\", \"layer\"")
}

/// Typed access to a request object's optional fields.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
}

impl Fields<'_> {
    fn string(&self, k: &str) -> Result<Option<String>, String> {
        match self.obj.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(format!("field \"{k}\" must be a string, got {}", show(v))),
        }
    }

    fn bool(&self, k: &str) -> Result<Option<bool>, String> {
        match self.obj.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(format!(
                "field \"{k}\" must be true or false, got {}",
                show(v)
            )),
        }
    }

    fn uint(&self, k: &str) -> Result<Option<u64>, String> {
        match self.obj.get(k) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                format!(
                    "field \"{k}\" must be a non-negative integer, got {}",
                    show(v)
                )
            }),
        }
    }

    /// The selector of prefetch/pin/unpin/evict: `None` when no selector field is present.
    fn target(&self, verb: &str) -> Result<Option<Target>, String> {
        let given: Vec<&str> = ["file", "tensor", "layer"]
            .into_iter()
            .filter(|k| self.obj.contains_key(*k))
            .collect();
        if given.len() > 1 {
            return Err(format!(
                "{verb} needs exactly one of \"file\", \"tensor\", \"layer\", got {}",
                given.join(" and ")
            ));
        }
        if self.obj.contains_key("range") && given != ["file"] {
            return Err("field \"range\" is only valid with \"file\"".into());
        }
        let Some(&which) = given.first() else {
            return Ok(None);
        };
        Ok(Some(match which {
            "file" => {
                let file = self.string("file")?.unwrap_or_default();
                if file.is_empty() {
                    return Err("field \"file\" must not be empty".into());
                }
                let range = match self.obj.get("range") {
                    None => None,
                    Some(v) => Some(parse_range(v)?),
                };
                Target::File { file, range }
            }
            "tensor" => {
                let t = self.string("tensor")?.unwrap_or_default();
                if t.is_empty() {
                    return Err("field \"tensor\" must not be empty".into());
                }
                Target::Tensor(t)
            }
            _ => {
                let n = self.uint("layer")?.unwrap_or_default();
                let n = u32::try_from(n)
                    .map_err(|_| format!("field \"layer\" is out of range, got {n}"))?;
                Target::Layer(n)
            }
        }))
    }
}

fn parse_range(v: &Value) -> Result<(u64, u64), String> {
    let bad = || {
        format!(
            "field \"range\" must be [start, end] with non-negative integers, got {}",
            show(v)
        )
    };
    let arr = v.as_array().ok_or_else(bad)?;
    let [a, b] = arr.as_slice() else {
        return Err(bad());
    };
    let (a, b) = (a.as_u64().ok_or_else(bad)?, b.as_u64().ok_or_else(bad)?);
    if a >= b {
        return Err(format!(
            "field \"range\" [{a}, {b}] is empty: start must be below end"
        ));
    }
    Ok((a, b))
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A value as it appears in an error message: its JSON, cut to a few dozen characters.
fn show(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 40 {
        let cut: String = s.chars().take(37).collect();
        format!("{cut}...")
    } else {
        s
    }
}

impl Serialize for Request {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_json().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Request {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        Request::from_json(&v).map_err(serde::de::Error::custom)
    }
}

/// One reply line: `{"ok":true, ...payload}` or `{"ok":false,"error":"..."}`.
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    /// The payload fields placed beside `"ok"`.
    Ok(Map<String, Value>),
    /// A one-line message.
    Err(String),
}

impl Response {
    /// A success reply: an object payload's fields go beside `"ok"`, `null` adds
    /// nothing, any other value goes under `"value"`.
    pub fn ok(payload: Value) -> Response {
        match payload {
            Value::Object(m) => Response::Ok(m),
            Value::Null => Response::Ok(Map::new()),
            other => {
                let mut m = Map::new();
                m.insert("value".into(), other);
                Response::Ok(m)
            }
        }
    }

    /// An error reply; the message is flattened to one line and cut to
    /// [`MAX_ERROR_LEN`] characters.
    pub fn error(msg: impl AsRef<str>) -> Response {
        let one: String = msg
            .as_ref()
            .chars()
            .map(|c| if c == '\n' || c == '\r' { ' ' } else { c })
            .take(MAX_ERROR_LEN)
            .collect();
        Response::Err(one)
    }

    /// The reply as a JSON object.
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        match self {
            Response::Ok(fields) => {
                m.insert("ok".into(), true.into());
                for (k, v) in fields {
                    if k != "ok" {
                        m.insert(k.clone(), v.clone());
                    }
                }
            }
            Response::Err(e) => {
                m.insert("ok".into(), false.into());
                m.insert("error".into(), e.clone().into());
            }
        }
        Value::Object(m)
    }

    /// The reply line, with its trailing newline.
    pub fn to_line(&self) -> String {
        let mut s = self.to_json().to_string();
        s.push('\n');
        s
    }

    /// Parses a reply line (the client side).
    pub fn parse_line(line: &str) -> Result<Response, String> {
        let v: Value =
            serde_json::from_str(line.trim_end()).map_err(|e| format!("invalid JSON: {e}"))?;
        let Value::Object(mut m) = v else {
            return Err(format!("reply must be a JSON object, got {}", kind_of(&v)));
        };
        match m.remove("ok") {
            Some(Value::Bool(true)) => Ok(Response::Ok(m)),
            Some(Value::Bool(false)) => match m.remove("error") {
                Some(Value::String(e)) => Ok(Response::Err(e)),
                _ => Ok(Response::Err("error reply without a message".into())),
            },
            _ => Err("reply has no boolean field \"ok\"".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(s: &str) -> Result<Request, String> {
        Request::parse_line(s.as_bytes())
    }

    #[test]
    fn round_trips_every_verb() {
        let all = [
            Request::Ping,
            Request::Stat,
            Request::Prefetch(Target::File {
                file: "model.gguf".into(),
                range: Some((10, 20)),
            }),
            Request::Pin(Target::File {
                file: "model.safetensors".into(),
                range: None,
            }),
            Request::Unpin(Target::Tensor("model.norm.weight".into())),
            Request::Evict(None),
            Request::Evict(Some(Target::Layer(3))),
            Request::Trace { on: true },
            Request::Route {
                prompt: "hi".into(),
                top_k: Some(4),
                budget_bytes: Some(1 << 40),
                prefetch: true,
                file: Some("model.safetensors".into()),
            },
            Request::Route {
                prompt: "x".into(),
                top_k: None,
                budget_bytes: None,
                prefetch: false,
                file: None,
            },
            Request::Materialize { file: None },
            Request::Materialize {
                file: Some("model.gguf".into()),
            },
        ];
        for r in all {
            let line = serde_json::to_string(&r).unwrap();
            assert_eq!(parse(&line).unwrap(), r, "{line}");
            assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), r);
        }
    }

    #[test]
    fn wire_forms() {
        assert_eq!(
            parse(r#"{"verb":"prefetch","file":"model.gguf","range":[0,4096]}"#).unwrap(),
            Request::Prefetch(Target::File {
                file: "model.gguf".into(),
                range: Some((0, 4096))
            })
        );
        assert_eq!(
            parse(r#"{"verb":"pin","layer":7}"#).unwrap(),
            Request::Pin(Target::Layer(7))
        );
        assert_eq!(
            parse("{\"verb\":\"trace\",\"on\":false}\r").unwrap(),
            Request::Trace { on: false }
        );
    }

    #[test]
    fn errors_name_the_problem() {
        let cases = [
            ("", "empty request line"),
            ("nope", "invalid JSON"),
            ("[1]", "must be a JSON object, got an array"),
            ("{}", "missing field \"verb\""),
            (r#"{"verb":3}"#, "\"verb\" must be a string"),
            (r#"{"verb":"stats"}"#, "unknown verb \"stats\""),
            (
                r#"{"verb":"stat","x":1}"#,
                "unknown field \"x\" for verb \"stat\"",
            ),
            (r#"{"verb":"prefetch"}"#, "prefetch needs exactly one of"),
            (
                r#"{"verb":"pin","file":"a","layer":1}"#,
                "got file and layer",
            ),
            (
                r#"{"verb":"pin","layer":"three"}"#,
                "\"layer\" must be a non-negative integer, got \"three\"",
            ),
            (r#"{"verb":"pin","layer":-1}"#, "non-negative integer"),
            (r#"{"verb":"pin","layer":5000000000}"#, "out of range"),
            (
                r#"{"verb":"pin","tensor":"t","range":[0,1]}"#,
                "only valid with \"file\"",
            ),
            (r#"{"verb":"pin","file":"f","range":[5,5]}"#, "is empty"),
            (
                r#"{"verb":"pin","file":"f","range":[1]}"#,
                "must be [start, end]",
            ),
            (
                r#"{"verb":"pin","file":"f","range":[1,"2"]}"#,
                "must be [start, end]",
            ),
            (r#"{"verb":"pin","file":""}"#, "must not be empty"),
            (r#"{"verb":"trace"}"#, "missing field \"on\""),
            (r#"{"verb":"trace","on":1}"#, "must be true or false"),
            (r#"{"verb":"route"}"#, "missing field \"prompt\""),
            (r#"{"verb":"route","prompt":""}"#, "must not be empty"),
            (r#"{"verb":"route","prompt":"p","top_k":0}"#, "at least 1"),
            (
                r#"{"verb":"route","prompt":"p","file":3}"#,
                "\"file\" must be a string",
            ),
            (
                r#"{"verb":"route","prompt":"p","budget_bytes":1.5}"#,
                "non-negative integer",
            ),
            (
                r#"{"verb":"materialize","file":7}"#,
                "\"file\" must be a string",
            ),
            (
                r#"{"verb":"materialize","range":[0,1]}"#,
                "unknown field \"range\"",
            ),
        ];
        for (line, want) in cases {
            let e = parse(line).unwrap_err();
            assert!(e.contains(want), "{line}: {e}");
            assert!(!e.contains('\n'));
        }
        assert!(Request::parse_line(b"\xff\xfe")
            .unwrap_err()
            .contains("UTF-8"));
    }

    /// Mutated valid requests and random bytes: parsing answers, never panics.
    #[test]
    fn parse_never_panics() {
        let seeds = [
            r#"{"verb":"prefetch","file":"model.gguf","range":[0,4096]}"#,
            r#"{"verb":"route","prompt":"p","top_k":3,"budget_bytes":9,"prefetch":true}"#,
            r#"{"verb":"trace","on":true}"#,
            r#"{"verb":"materialize","file":"model.gguf"}"#,
        ];
        let mut x = 0x9e3779b97f4a7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for i in 0..20_000 {
            let mut b = seeds[i % seeds.len()].as_bytes().to_vec();
            for _ in 0..(next() % 4 + 1) {
                if b.is_empty() {
                    break;
                }
                let pos = (next() as usize) % b.len();
                match next() % 3 {
                    0 => b[pos] = next() as u8,
                    1 => {
                        b.remove(pos);
                    }
                    _ => b.insert(pos, b"{}[]\",:0-9e\"\\"[(next() % 12) as usize]),
                }
            }
            if let Err(e) = Request::parse_line(&b) {
                assert!(!e.contains('\n'));
            }
        }
    }

    #[test]
    fn long_values_are_cut_in_messages() {
        let long = "x".repeat(5000);
        let e = parse(&format!(r#"{{"verb":"pin","layer":"{long}"}}"#)).unwrap_err();
        assert!(e.len() < 200, "{e}");
    }

    #[test]
    fn responses() {
        let r = Response::ok(json!({"hits": 3}));
        assert_eq!(r.to_line(), "{\"ok\":true,\"hits\":3}\n");
        assert_eq!(Response::parse_line(&r.to_line()).unwrap(), r);
        assert_eq!(
            Response::ok(json!(5)).to_line(),
            "{\"ok\":true,\"value\":5}\n"
        );
        assert_eq!(Response::ok(Value::Null).to_line(), "{\"ok\":true}\n");
        // A payload cannot fake the status.
        assert_eq!(
            Response::ok(json!({"ok": false})).to_line(),
            "{\"ok\":true}\n"
        );
        let e = Response::error("two\nlines");
        assert_eq!(e.to_line(), "{\"ok\":false,\"error\":\"two lines\"}\n");
        assert_eq!(Response::parse_line(&e.to_line()).unwrap(), e);
        assert!(Response::parse_line("{}").is_err());
        assert!(Response::error("y".repeat(5000)).to_line().len() < MAX_ERROR_LEN + 40);
    }
}
