//! Sizes as people write them: `10G`, `512M`, `1.5G`, `4096` — in flags and in the TOML configuration
//! alike (`cache_size = "10G"` or `cache_size = 10737418240`). Units are binary (K = 1024) and
//! case-insensitive; a trailing `B` or `iB` is allowed (`10GiB`, `512MB`).

use std::fmt;

use serde::de::{self, Deserializer, Visitor};

/// A string that is not a size.
#[derive(Debug, thiserror::Error)]
#[error("size {text:?}: {why} (write e.g. 10G, 512M, 4096)")]
pub struct SizeError {
    /// The text given.
    pub text: String,
    /// What is wrong with it.
    pub why: &'static str,
}

/// Parses a size: a non-negative number, optionally fractional, and an optional unit K, M, G or T.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let err = |why| SizeError {
        text: text.to_string(),
        why,
    };
    let s = text.trim();
    let s = s
        .strip_suffix("iB")
        .or_else(|| s.strip_suffix(['B', 'b']))
        .unwrap_or(s);
    let (num, mult) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => return Err(err("unknown unit (K, M, G, T)")),
            };
            (&s[..i], m)
        }
        _ => (s, 1),
    };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or_else(|| err("too large"));
    }
    let n: f64 = num.trim().parse().map_err(|_| err("not a number"))?;
    let bytes = n * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 {
        return Err(err("not a non-negative number"));
    }
    if bytes >= u64::MAX as f64 {
        return Err(err("too large"));
    }
    Ok(bytes as u64)
}

/// For `#[serde(deserialize_with)]`: a size given as an integer or as a string with a unit.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    d.deserialize_any(SizeVisitor)
}

/// [`deserialize`] for an optional size (absent: the field's default).
pub fn deserialize_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    deserialize(d).map(Some)
}

struct SizeVisitor;

impl Visitor<'_> for SizeVisitor {
    type Value = u64;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a size: a number of bytes, or a string such as \"10G\" or \"512M\"")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
        u64::try_from(v).map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
        parse_size(v).map_err(E::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        for (text, want) in [
            ("4096", 4096),
            ("10G", 10 << 30),
            ("512m", 512 << 20),
            ("1.5K", 1536),
            (" 2T ", 2 << 40),
            ("10GiB", 10 << 30),
            ("64KB", 64 << 10),
            ("0", 0),
        ] {
            assert_eq!(parse_size(text).unwrap(), want, "{text}");
        }
        for bad in ["", "G", "10X", "-1G", "ten", "nanG", "inf", "99999999999T"] {
            let e = parse_size(bad).expect_err(bad);
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct Sizes {
        #[serde(deserialize_with = "deserialize")]
        a: u64,
        #[serde(default, deserialize_with = "deserialize_opt")]
        b: Option<u64>,
    }

    #[test]
    fn json_takes_integers_and_strings() {
        let s: Sizes = serde_json::from_str(r#"{"a": "10G", "b": 4096}"#).unwrap();
        assert_eq!(
            s,
            Sizes {
                a: 10 << 30,
                b: Some(4096)
            }
        );
        let s: Sizes = serde_json::from_str(r#"{"a": 7}"#).unwrap();
        assert_eq!(s, Sizes { a: 7, b: None });
        let e = serde_json::from_str::<Sizes>(r#"{"a": "10Q"}"#).unwrap_err();
        assert!(e.to_string().contains("10Q"), "{e}");
        assert!(serde_json::from_str::<Sizes>(r#"{"a": -3}"#).is_err());
    }
}
