//! An insertion-ordered JSON value and Python-compatible `json.dumps` output.
//!
//! Spec §6.4 renders tool-call arguments "in insertion order" with `json.dumps(ensure_ascii=False)`
//! (separators `", "` and `": "`), and tool/schema declarations with compact separators after a
//! deep key sort; spec §7.3 emits parsed arguments the same way, in emitted order. `serde_json`'s
//! `Value` sorts object keys unless a workspace-wide feature is switched on, and it formats floats
//! differently from Python (`1e16` vs `1e+16`), so this module keeps its own small value type.
//! Python's float `repr` is reproduced exactly: shortest round-trip digits, fixed notation for
//! decimal exponents in `-4..16`, otherwise `d.ddde±XX`.

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use std::fmt::{self, Write};

/// A JSON value whose objects keep their keys in insertion order.
#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    /// `null`
    Null,
    /// `true` / `false`
    Bool(bool),
    /// A number that fits `i64`/`u64` (Python `int`).
    Int(i128),
    /// Any other number (Python `float`).
    Float(f64),
    /// A string.
    Str(String),
    /// An array.
    Array(Vec<Json>),
    /// An object; a repeated key keeps its first position and its last value, as a Python dict.
    Object(Vec<(String, Json)>),
}

impl Json {
    /// Parses JSON text. Returns `None` when `text` is not one complete JSON value.
    pub fn parse(text: &str) -> Option<Json> {
        serde_json::from_str(text).ok()
    }

    /// The string inside `Json::Str`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }

    /// Looks a key up in an object (`None` for other kinds and for missing keys).
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(fields) => fields.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// Python truthiness: `None`, `False`, `0`, `""`, `[]` and `{}` are false.
    pub fn truthy(&self) -> bool {
        match self {
            Json::Null => false,
            Json::Bool(b) => *b,
            Json::Int(i) => *i != 0,
            Json::Float(f) => *f != 0.0,
            Json::Str(s) => !s.is_empty(),
            Json::Array(a) => !a.is_empty(),
            Json::Object(o) => !o.is_empty(),
        }
    }

    /// Returns a copy with every object's keys sorted, recursively (`deep_sort_dict`).
    pub fn deep_sorted(&self) -> Json {
        match self {
            Json::Array(items) => Json::Array(items.iter().map(Json::deep_sorted).collect()),
            Json::Object(fields) => {
                let mut sorted: Vec<(String, Json)> = fields.iter().map(|(k, v)| (k.clone(), v.deep_sorted())).collect();
                sorted.sort_by(|a, b| a.0.cmp(&b.0));
                Json::Object(sorted)
            }
            other => other.clone(),
        }
    }

    /// `json.dumps(value, ensure_ascii=False)`: separators `", "` and `": "`.
    pub fn dumps(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, ", ", ": ");
        out
    }

    /// `json.dumps(value, ensure_ascii=False, separators=(",", ":"))`.
    pub fn dumps_compact(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, ",", ":");
        out
    }

    /// Python `str(value)` for attribute values: strings unchanged, `True`/`False`/`None`,
    /// numbers as Python prints them, containers as compact JSON.
    pub fn python_str(&self) -> String {
        match self {
            Json::Str(s) => s.clone(),
            Json::Bool(true) => "True".into(),
            Json::Bool(false) => "False".into(),
            Json::Null => "None".into(),
            other => other.dumps(),
        }
    }

    fn write(&self, out: &mut String, item_sep: &str, key_sep: &str) {
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Int(i) => {
                let _ = write!(out, "{i}");
            }
            Json::Float(f) => out.push_str(&python_float_repr(*f)),
            Json::Str(s) => write_string(out, s),
            Json::Array(items) => {
                out.push('[');
                for (n, item) in items.iter().enumerate() {
                    if n > 0 {
                        out.push_str(item_sep);
                    }
                    item.write(out, item_sep, key_sep);
                }
                out.push(']');
            }
            Json::Object(fields) => {
                out.push('{');
                for (n, (k, v)) in fields.iter().enumerate() {
                    if n > 0 {
                        out.push_str(item_sep);
                    }
                    write_string(out, k);
                    out.push_str(key_sep);
                    v.write(out, item_sep, key_sep);
                }
                out.push('}');
            }
        }
    }
}

/// Inserts like a Python dict assignment: a repeated key keeps its place and takes the new value.
pub(crate) fn insert_ordered(fields: &mut Vec<(String, Json)>, key: String, value: Json) {
    match fields.iter_mut().find(|(k, _)| *k == key) {
        Some(slot) => slot.1 = value,
        None => fields.push((key, value)),
    }
}

/// A JSON string literal as Python's encoder writes it with `ensure_ascii=False`.
fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`.
pub fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    // `{:e}` gives the shortest round-trip digits, e.g. "-1.2345e17" or "1e-5".
    let sci = format!("{:e}", f);
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (neg, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::new();
    if neg {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        let decpt = exp + 1;
        if decpt <= 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-decpt) as usize));
            out.push_str(&digits);
        } else if decpt as usize >= digits.len() {
            out.push_str(&digits);
            out.extend(std::iter::repeat_n('0', decpt as usize - digits.len()));
            out.push_str(".0");
        } else {
            out.push_str(&digits[..decpt as usize]);
            out.push('.');
            out.push_str(&digits[decpt as usize..]);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Json, D::Error> {
        deserializer.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_none<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Json, D::Error> {
        Json::deserialize(d)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Json, E> {
        Ok(Json::Int(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Json, E> {
        Ok(Json::Int(v.into()))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Json, E> {
        Ok(Json::Float(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Json, E> {
        Ok(Json::Str(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Json, E> {
        Ok(Json::Str(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut fields = Vec::new();
        while let Some((k, v)) = map.next_entry::<String, Json>()? {
            insert_ordered(&mut fields, k, v);
        }
        Ok(Json::Object(fields))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (0.1, "0.1"),
            (1.5e300, "1.5e+300"),
            (-0.0, "-0.0"),
            (3.0, "3.0"),
            (0.25, "0.25"),
            (-2.5e-7, "-2.5e-07"),
        ];
        for (f, want) in cases {
            assert_eq!(python_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn dumps_keeps_order_and_python_separators() {
        let v = Json::parse(r#"{"b": [1, 2.0, "x\u0001\n"], "a": {"z": null, "y": true}}"#).unwrap();
        assert_eq!(v.dumps(), r#"{"b": [1, 2.0, "x\u0001\n"], "a": {"z": null, "y": true}}"#);
        assert_eq!(v.deep_sorted().dumps_compact(), r#"{"a":{"y":true,"z":null},"b":[1,2.0,"x\u0001\n"]}"#);
    }

    #[test]
    fn repeated_key_keeps_first_position_last_value() {
        let v = Json::parse(r#"{"a": 1, "b": 2, "a": 3}"#).unwrap();
        assert_eq!(v.dumps(), r#"{"a": 3, "b": 2}"#);
    }
}
