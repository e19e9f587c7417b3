//! Workload kinds an operator adds by configuration (`--custom-kind`): a CRD whose objects
//! carry a Pod template, such as Argo Rollouts' `Rollout`. They are registered once at
//! start-up into a process-wide table, so that `WorkloadKind` stays a two-byte `Copy` key (a
//! pointer would make every workload key eight bytes larger, held several times per
//! workload) and answers its names as `&'static str` like the built-in kinds.

use std::sync::RwLock;

/// One configured kind: where it is served and where its Pod template is.
#[derive(Debug, PartialEq, Eq)]
pub struct CustomKind {
    pub group: &'static str,
    pub version: &'static str,
    pub kind: &'static str,
    pub plural: &'static str,
    /// `group/version`.
    pub api_version: &'static str,
    /// `<Kind>List`.
    pub list_kind: &'static str,
    /// The Pod template's path from the object's root (`spec.template`), one field a segment.
    pub template: &'static [&'static str],
}

impl CustomKind {
    /// The name of the CRD that serves it (`<plural>.<group>`).
    pub fn crd_name(&self) -> String {
        format!("{}.{}", self.plural, self.group)
    }
}

/// Which configured kind: an index into the table. At most 256 kinds, each configured once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CustomKindId(u8);

/// Every kind registered in this process, never removed (each is leaked once: a handful of
/// short strings for the process's life).
static REGISTERED: RwLock<Vec<&'static CustomKind>> = RwLock::new(Vec::new());

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CustomKindError {
    #[error(
        "--custom-kind {0:?}: expected <group>/<version>/<Kind>/<plural>[:<template path>], e.g. argoproj.io/v1alpha1/Rollout/rollouts:spec.template"
    )]
    Shape(String),
    #[error("--custom-kind {text:?}: {what}")]
    Invalid { text: String, what: &'static str },
    #[error("--custom-kind {0:?}: more than 256 custom kinds")]
    TooMany(String),
}

/// Parses one `--custom-kind` value: `<group>/<version>/<Kind>/<plural>[:<template path>]`,
/// the path defaulting to `spec.template`. Whether the kind is a built-in one's name is
/// `WorkloadKind::register_custom`'s to check.
pub fn parse(text: &str) -> Result<CustomKind, CustomKindError> {
    let text = text.trim();
    let (resource, path) = text.split_once(':').unwrap_or((text, "spec.template"));
    let parts: Vec<&str> = resource.split('/').collect();
    let [group, version, kind, plural] = parts.as_slice() else {
        return Err(CustomKindError::Shape(text.to_owned()));
    };
    let invalid = |what| CustomKindError::Invalid {
        text: text.to_owned(),
        what,
    };
    if !is_dns_subdomain(group) || !group.contains('.') {
        return Err(invalid(
            "the group must be a CRD's API group (a lowercase DNS name with a dot)",
        ));
    }
    if !is_dns_label(version) || !version.starts_with(|c: char| c.is_ascii_lowercase()) {
        return Err(invalid(
            "the version must be a lowercase DNS label starting with a letter",
        ));
    }
    if !kind.starts_with(|c: char| c.is_ascii_uppercase())
        || !kind.chars().all(|c| c.is_ascii_alphanumeric())
    {
        return Err(invalid(
            "the kind must be CamelCase letters and digits, as in an object's kind",
        ));
    }
    if !is_dns_label(plural) {
        return Err(invalid("the plural must be a lowercase DNS label"));
    }
    let segments: Vec<&str> = path.split('.').collect();
    if segments.iter().any(|s| {
        !s.starts_with(|c: char| c.is_ascii_alphabetic())
            || !s.chars().all(|c| c.is_ascii_alphanumeric())
    }) {
        return Err(invalid(
            "the template path must be field names joined by dots, e.g. spec.template",
        ));
    }
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    let template: Vec<&'static str> = segments.iter().map(|s| leak((*s).to_owned())).collect();
    Ok(CustomKind {
        group: leak((*group).to_owned()),
        version: leak((*version).to_owned()),
        kind: leak((*kind).to_owned()),
        plural: leak((*plural).to_owned()),
        api_version: leak(format!("{group}/{version}")),
        list_kind: leak(format!("{kind}List")),
        template: Box::leak(template.into_boxed_slice()),
    })
}

/// Registers `kind` for the process's life; the same group, version and kind again is the
/// same id (the first registration's plural and path stand).
pub fn register(kind: CustomKind, text: &str) -> Result<CustomKindId, CustomKindError> {
    let mut registered = REGISTERED.write().unwrap_or_else(|p| p.into_inner());
    let same =
        |k: &&CustomKind| k.group == kind.group && k.version == kind.version && k.kind == kind.kind;
    if let Some(index) = registered.iter().position(same) {
        return Ok(CustomKindId(index as u8));
    }
    let index =
        u8::try_from(registered.len()).map_err(|_| CustomKindError::TooMany(text.into()))?;
    registered.push(Box::leak(Box::new(kind)));
    Ok(CustomKindId(index))
}

/// The registered kind `id` names (ids exist only once registered).
pub fn get(id: CustomKindId) -> &'static CustomKind {
    REGISTERED.read().unwrap_or_else(|p| p.into_inner())[usize::from(id.0)]
}

/// Every registered kind.
pub fn all() -> Vec<CustomKindId> {
    let count = REGISTERED.read().unwrap_or_else(|p| p.into_inner()).len();
    (0..count).map(|i| CustomKindId(i as u8)).collect()
}

fn is_dns_label(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 63
        && text
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !text.starts_with('-')
        && !text.ends_with('-')
}

fn is_dns_subdomain(text: &str) -> bool {
    text.len() <= 253 && text.split('.').all(is_dns_label)
}

/// The service account fields of the Pod template at `template` in a JSON object:
/// (`serviceAccountName`, `serviceAccount`).
pub fn template_service_account(
    object: &serde_json::Value,
    template: &[&str],
) -> (Option<String>, Option<String>) {
    let pod = template
        .iter()
        .try_fold(object, |value, field| value.get(field))
        .and_then(|t| t.get("spec"));
    let field = |name| {
        pod.and_then(|p| p.get(name))
            .and_then(|v| v.as_str())
            .map(str::to_owned)
    };
    (field("serviceAccountName"), field("serviceAccount"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_service_account_is_read_at_the_configured_path() {
        let object = json!({ "spec": { "workload": { "podTemplate": { "spec": { "serviceAccountName": "runner" } } } } });
        assert_eq!(
            template_service_account(&object, &["spec", "workload", "podTemplate"]),
            (Some("runner".into()), None)
        );
        assert_eq!(
            template_service_account(&object, &["spec", "template"]),
            (None, None),
            "nothing there: the kubelet's default applies"
        );
    }
}
