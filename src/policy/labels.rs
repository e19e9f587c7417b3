//! Label sets as selectors read them. The cache keeps one per Deployment, so it is one sorted
//! string rather than a `BTreeMap`, whose first node alone takes about half a kilobyte
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

/// An immutable label set, sorted by key, in one allocation: `key\0value\0key\0value`. The
/// cache holds one per Deployment, and a slice of boxed pairs took five allocations for the
/// usual two labels. The apiserver admits no NUL in a label key or value (both are restricted to
/// DNS-style characters), so the separator cannot occur inside one.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Labels(Box<str>);

const SEPARATOR: char = '\0';

impl Labels {
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        let mut parts = (!self.0.is_empty())
            .then(|| self.0.split(SEPARATOR))
            .into_iter()
            .flatten();
        std::iter::from_fn(move || Some((parts.next()?, parts.next().unwrap_or_default())))
    }

    pub fn len(&self) -> usize {
        self.iter().count()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Builds from pairs already sorted by key (a `BTreeMap`'s order).
    fn from_sorted<'a>(pairs: impl Iterator<Item = (&'a str, &'a str)>) -> Self {
        let mut joined = String::new();
        for (key, value) in pairs {
            debug_assert!(!key.contains(SEPARATOR) && !value.contains(SEPARATOR));
            if !joined.is_empty() {
                joined.push(SEPARATOR);
            }
            joined.push_str(key);
            joined.push(SEPARATOR);
            joined.push_str(value);
        }
        Labels(joined.into_boxed_str())
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
        let empty_value = Labels::from(&BTreeMap::from([("k".to_string(), String::new())]));
        assert_eq!(empty_value.label("k"), Some(""));
        assert_eq!(empty_value.len(), 1);
    }
}
