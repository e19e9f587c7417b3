//! Label sets as selectors read them. The cache keeps one per Deployment, so it is one sorted
//! string and its boundaries rather than a `BTreeMap`, whose first node alone takes about half a kilobyte
//! whatever the number of labels: at 50,000 Deployments that is the difference between
//! fitting the memory target and not.

use std::collections::BTreeMap;

/// Something selectors can look labels up in.
pub trait LabelSource {
    fn label(&self, key: &str) -> Option<&str>;
}

impl LabelSource for BTreeMap<String, String> {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

/// An immutable label set, sorted by key: every key and value in one string, and where each
/// ends. The cache holds one per Deployment, and a slice of boxed pairs took five allocations
/// for the usual two labels; this takes two. No separator character: the webhook sees objects
/// before the apiserver validates them, so a label may hold any character.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Labels {
    text: Box<str>,
    /// Where each key, then its value, ends in `text` (inputs are bounded by the 4 MiB body
    /// limit, far below `u32::MAX`).
    ends: Box<[u32]>,
}

impl Labels {
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        let part = |i: usize| {
            let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
            &self.text[start..self.ends[i] as usize]
        };
        (0..self.ends.len() / 2).map(move |i| (part(2 * i), part(2 * i + 1)))
    }

    pub fn len(&self) -> usize {
        self.ends.len() / 2
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Builds from pairs already sorted by key (a `BTreeMap`'s order).
    fn from_sorted<'a>(pairs: impl ExactSizeIterator<Item = (&'a str, &'a str)>) -> Self {
        let mut text = String::new();
        let mut ends = Vec::with_capacity(2 * pairs.len());
        for (key, value) in pairs {
            for part in [key, value] {
                text.push_str(part);
                ends.push(u32::try_from(text.len()).unwrap_or(u32::MAX));
            }
        }
        Labels {
            text: text.into_boxed_str(),
            ends: ends.into_boxed_slice(),
        }
    }
}

impl std::fmt::Debug for Labels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl LabelSource for Labels {
    fn label(&self, key: &str) -> Option<&str> {
        self.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }
}

impl From<BTreeMap<String, String>> for Labels {
    fn from(map: BTreeMap<String, String>) -> Self {
        Labels::from(&map)
    }
}

impl From<&BTreeMap<String, String>> for Labels {
    fn from(map: &BTreeMap<String, String>) -> Self {
        Labels::from_sorted(map.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn looks_up_like_the_map_it_came_from() {
        let map: BTreeMap<String, String> = [("b", "2"), ("a", "1"), ("c", "3")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let labels = Labels::from(&map);
        for key in ["a", "b", "c", "d", ""] {
            assert_eq!(labels.label(key), map.label(key), "{key}");
        }
        assert_eq!(labels.len(), 3);
        assert_eq!(
            labels.iter().collect::<Vec<_>>(),
            [("a", "1"), ("b", "2"), ("c", "3")]
        );
        assert!(Labels::default().is_empty());
        assert_eq!(Labels::default().iter().count(), 0);
        let odd = Labels::from(&BTreeMap::from([
            ("k".to_string(), String::new()),
            ("nul\0key".to_string(), "a\0b".to_string()),
        ]));
        assert_eq!(odd.label("k"), Some(""));
        assert_eq!(
            odd.label("nul\0key"),
            Some("a\0b"),
            "any character, as the webhook sees it"
        );
        assert_eq!(odd.len(), 2);
    }
}
