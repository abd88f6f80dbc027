//! A GGUF string array kept as one text buffer and the end offset of each string: a
//! 49 k-token vocabulary plus its 49 k merges as `Vec<String>` cost ~5 MiB in small
//! allocations for ~1 MiB of text, for the whole life of a mount.

use serde::de::{DeserializeSeed, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[derive(Clone, Default, PartialEq, Eq)]
pub struct StrList {
    text: String,
    /// String `i` is `text[ends[i-1]..ends[i]]` (`ends[-1]` = 0).
    ends: Vec<usize>,
}

impl StrList {
    pub const EMPTY: StrList = StrList {
        text: String::new(),
        ends: Vec::new(),
    };

    pub fn with_capacity(strings: usize) -> StrList {
        StrList {
            text: String::new(),
            ends: Vec::with_capacity(strings),
        }
    }

    pub fn push(&mut self, s: &str) {
        self.text.push_str(s);
        self.ends.push(self.text.len());
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)?;
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        Some(&self.text[start..end])
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        (0..self.len()).map(|i| &self[i])
    }

    /// Drop spare capacity (the reader grows the text buffer as it goes).
    pub fn shrink_to_fit(&mut self) {
        self.text.shrink_to_fit();
        self.ends.shrink_to_fit();
    }
}

impl std::ops::Index<usize> for StrList {
    type Output = str;
    fn index(&self, i: usize) -> &str {
        match self.get(i) {
            Some(s) => s,
            None => panic!("string {i} of a list of {}", self.len()),
        }
    }
}

impl<S: AsRef<str>> FromIterator<S> for StrList {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> StrList {
        let mut l = StrList::default();
        for s in iter {
            l.push(s.as_ref());
        }
        l.shrink_to_fit();
        l
    }
}

impl From<Vec<String>> for StrList {
    fn from(v: Vec<String>) -> StrList {
        v.into_iter().collect()
    }
}

impl std::fmt::Debug for StrList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl Serialize for StrList {
    fn serialize<Ser: Serializer>(&self, s: Ser) -> Result<Ser::Ok, Ser::Error> {
        s.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for StrList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<StrList, D::Error> {
        struct Seq;
        impl<'de> serde::de::Visitor<'de> for Seq {
            type Value = StrList;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a sequence of strings")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<StrList, A::Error> {
                // The size hint comes from the input: bounded, not trusted.
                let mut l = StrList::with_capacity(a.size_hint().unwrap_or(0).min(1 << 16));
                while a.next_element_seed(Push(&mut l))?.is_some() {}
                l.shrink_to_fit();
                Ok(l)
            }
        }
        d.deserialize_seq(Seq)
    }
}

/// One string of a sequence, appended to the list as it is read. A `Cow<str>` element
/// became a `String` of its own first (serde's `Cow` is always owned): one allocation
/// per token, ~100 k of them in a restart's META.
struct Push<'l>(&'l mut StrList);

impl<'de> DeserializeSeed<'de> for Push<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for Push<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<(), E> {
        self.0.push(s);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_round_trip() {
        let v = vec!["<s>".to_string(), String::new(), "Ġa b".into(), "é".into()];
        let l = StrList::from(v.clone());
        assert_eq!(l.len(), 4);
        assert_eq!(l.iter().collect::<Vec<_>>(), v);
        assert_eq!(&l[2], "Ġa b");
        assert_eq!(l.get(1), Some(""));
        assert_eq!(l.get(4), None);
        let json = serde_json::to_string(&l).unwrap();
        assert_eq!(json, serde_json::to_string(&v).unwrap());
        assert_eq!(serde_json::from_str::<StrList>(&json).unwrap(), l);
        assert_eq!(format!("{l:?}"), format!("{v:?}"));
        assert!(StrList::EMPTY.is_empty());
    }

    #[test]
    fn escaped_strings_and_other_sources_parse() {
        let json = r#"["a\"b", "\u00e9\n", "plain", ""]"#;
        let want = ["a\"b", "é\n", "plain", ""];
        let from_str: StrList = serde_json::from_str(json).unwrap();
        assert_eq!(from_str.iter().collect::<Vec<_>>(), want);
        // A reader hands strings over one by one, never borrowed from the input.
        let from_reader: StrList = serde_json::from_reader(json.as_bytes()).unwrap();
        assert_eq!(from_reader, from_str);
        let value = serde_json::from_str::<serde_json::Value>(json).unwrap();
        assert_eq!(serde_json::from_value::<StrList>(value).unwrap(), from_str);
        let e = serde_json::from_str::<StrList>(r#"["a", 1]"#).unwrap_err();
        assert!(e.to_string().contains("expected a string"), "{e}");
    }
}
