//! Label sets as selectors read them. The cache keeps one per Deployment, so it is a sorted
//! boxed slice rather than a `BTreeMap`, whose first node alone takes about half a kilobyte
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

/// An immutable label set, sorted by key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Labels(Box<[(Box<str>, Box<str>)]>);

impl Labels {
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_ref(), v.as_ref()))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl LabelSource for Labels {
    fn label(&self, key: &str) -> Option<&str> {
        self.0
            .binary_search_by(|(k, _)| k.as_ref().cmp(key))
            .ok()
            .map(|i| self.0[i].1.as_ref())
    }
}

impl From<BTreeMap<String, String>> for Labels {
    fn from(map: BTreeMap<String, String>) -> Self {
        // A BTreeMap iterates in key order: the slice is sorted as built.
        Labels(
            map.into_iter()
                .map(|(k, v)| (k.into_boxed_str(), v.into_boxed_str()))
                .collect(),
        )
    }
}

impl From<&BTreeMap<String, String>> for Labels {
    fn from(map: &BTreeMap<String, String>) -> Self {
        Labels(
            map.iter()
                .map(|(k, v)| (Box::from(k.as_str()), Box::from(v.as_str())))
                .collect(),
        )
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
        assert!(Labels::default().is_empty());
    }
}
