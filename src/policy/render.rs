//! Renders the identity of one workload under one policy: a pure function shared by the webhook
//! (the annotation it stamps) and the controller (the entry it writes), so both always agree.
//!
//! The SPIFFE ID may only depend on the trust domain, the namespace and the service account,
//! because the entry's selectors are exactly `k8s:ns:<ns>` and `k8s:sa:<sa>`: any other input
//! would give pods of one service account several identities.

use super::crd::{DEFAULT_SPIFFE_ID_TEMPLATE, SpiffeRegistrationSpec};
use super::duration::{DurationError, parse_ttl};
use super::spiffe_id::{SpiffeIdError, check, valid_trust_domain};
use crate::spire::{Entry, Ownership, Selector};

/// The parts of a Deployment that identity depends on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload<'a> {
    pub namespace: &'a str,
    /// Pod template's service account; `default` when unset.
    pub service_account: &'a str,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    #[error("trustDomain {0:?} is invalid (lowercase letters, digits, '.', '_', '-'; no scheme)")]
    TrustDomain(String),
    #[error("parentID: {0}")]
    ParentId(SpiffeIdError),
    #[error(
        "spiffeIDTemplate: unknown placeholder {{{0}}} (allowed: trustDomain, namespace, serviceAccount)"
    )]
    Placeholder(String),
    #[error("spiffeIDTemplate renders an invalid SPIFFE ID: {0}")]
    SpiffeId(SpiffeIdError),
    #[error(transparent)]
    Ttl(#[from] DurationError),
    #[error(
        "spiffeIDTemplate {0:?}: {{namespace}} and {{serviceAccount}} must each appear exactly once, as whole path segments, namespace first (so two workloads never share an ID)"
    )]
    TemplateShape(String),
    #[error("dnsNames: {0:?} is not a valid DNS name")]
    DnsName(String),
    #[error(
        "dnsNames template {0:?}: placeholders must be whole DNS labels, and {1:?} would add labels of its own"
    )]
    DnsLabel(String, String),
    #[error("federatesWith: {0:?} is not a valid trust domain")]
    FederatesWith(String),
}

impl RenderError {
    /// CamelCase reason for conditions and Events.
    pub fn reason(&self) -> &'static str {
        match self {
            RenderError::TrustDomain(_) => "InvalidTrustDomain",
            RenderError::ParentId(_) => "InvalidParentID",
            RenderError::Placeholder(_)
            | RenderError::SpiffeId(_)
            | RenderError::TemplateShape(_) => "InvalidSpiffeIDTemplate",
            RenderError::Ttl(_) => "InvalidTTL",
            RenderError::DnsName(_) | RenderError::DnsLabel(..) => "InvalidDNSName",
            RenderError::FederatesWith(_) => "InvalidFederatesWith",
        }
    }
}

/// Substitutes `{trustDomain}`, `{namespace}`, `{serviceAccount}`; any other `{…}` is an error.
fn fill(template: &str, trust_domain: &str, workload: &Workload) -> Result<String, RenderError> {
    let mut out = String::with_capacity(template.len() + 32);
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let close = after
            .find('}')
            .ok_or_else(|| RenderError::Placeholder(after.to_string()))?;
        let value = match &after[..close] {
            "trustDomain" => trust_domain,
            "namespace" => workload.namespace,
            "serviceAccount" => workload.service_account,
            other => return Err(RenderError::Placeholder(other.to_string())),
        };
        out.push_str(value);
        rest = &after[close + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The template shape the CRD enforces (`crd::TEMPLATE_RULE`), checked again for policies
/// stored before that rule existed: host literal or `{trustDomain}`; path segments literal or
/// exactly `{namespace}` / `{serviceAccount}`, each of those once, namespace first. Kubernetes
/// names never contain '/', so each placeholder fills exactly one segment and distinct
/// (namespace, service account) pairs render distinct IDs.
pub fn check_template(template: &str) -> Result<(), RenderError> {
    let bad = || RenderError::TemplateShape(template.to_string());
    let rest = template.strip_prefix("spiffe://").ok_or_else(bad)?;
    let mut parts = rest.split('/');
    let host = parts.next().unwrap_or_default();
    if host != "{trustDomain}" && (host.is_empty() || host.contains(['{', '}'])) {
        return Err(bad());
    }
    let mut order = Vec::new();
    for segment in parts {
        match segment {
            "{namespace}" | "{serviceAccount}" => order.push(segment),
            literal if !literal.is_empty() && !literal.contains(['{', '}']) => {}
            _ => return Err(bad()),
        }
    }
    if order != ["{namespace}", "{serviceAccount}"] {
        return Err(bad());
    }
    Ok(())
}

/// What one DNS name template gives a workload.
enum DnsName {
    Rendered(String),
    /// Left out of this workload's entry, and why: the template is valid, but this workload's
    /// names do not fit in it (a dotted service account would add labels; a long one would
    /// overflow a label). The entry is made without it.
    Omitted(String),
}

/// Renders one DNS name template. Placeholders must be whole labels, and a namespace or
/// service account must fill exactly one label (service account names may contain dots).
/// A template that no workload could fill is an error of the policy; one that only this
/// workload's names break is `Omitted`.
fn render_dns_name(
    template: &str,
    trust_domain: &str,
    workload: &Workload,
) -> Result<DnsName, RenderError> {
    let mut labels = Vec::new();
    for label in template.split('.') {
        let value = match label {
            "{trustDomain}" => trust_domain,
            "{namespace}" => workload.namespace,
            "{serviceAccount}" => workload.service_account,
            literal if literal.contains(['{', '}']) => {
                return Err(RenderError::DnsLabel(template.into(), literal.into()));
            }
            literal => literal,
        };
        if label != "{trustDomain}" && value.contains('.') {
            return Ok(DnsName::Omitted(format!(
                "dnsNames template {template:?} left out: {value:?} would add DNS labels of its own"
            )));
        }
        labels.push(value);
    }
    let name = labels.join(".");
    if valid_dns_name(&name) {
        return Ok(DnsName::Rendered(name));
    }
    // Filled with a short valid label, does the template itself make a valid name?
    let sample = template
        .split('.')
        .map(|label| match label {
            "{trustDomain}" => trust_domain,
            "{namespace}" | "{serviceAccount}" => "x",
            literal => literal,
        })
        .collect::<Vec<_>>()
        .join(".");
    if !valid_dns_name(&sample) {
        return Err(RenderError::DnsName(name));
    }
    Ok(DnsName::Omitted(format!(
        "dnsNames template {template:?} left out: {name:?} is not a valid DNS name (labels of at most 63 characters, 253 in all)"
    )))
}

/// A DNS name as SPIRE accepts it in `dns_names`: ASCII labels, at most one leading `*.`.
pub fn valid_dns_name(name: &str) -> bool {
    let name = name.strip_prefix("*.").unwrap_or(name);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// Checks what does not depend on a workload; the controller reports these on the policy.
pub fn validate(spec: &SpiffeRegistrationSpec) -> Result<(), RenderError> {
    // Any syntactically valid workload exercises every check that does not depend on it; the
    // node alias's ID is valid by construction.
    render_unclaimed(
        spec,
        &Workload {
            namespace: "default",
            service_account: "default",
        },
        &|trust_domain| format!("spiffe://{trust_domain}/node-alias"),
    )
    .map(|_| ())
}

/// The SPIRE entry `spec` gives `workload`, named and hinted by `ownership`: the one place
/// policy output becomes an entry (the controller creates it; the webhook stamps its SPIFFE ID
/// and checks `entry-id` against its ID).
pub fn render(
    spec: &SpiffeRegistrationSpec,
    workload: &Workload,
    ownership: &Ownership,
) -> Result<Rendered, RenderError> {
    let Rendered { entry, dns_omitted } = render_unclaimed(spec, workload, &|trust_domain| {
        ownership.node_alias_id(trust_domain)
    })?;
    Ok(Rendered {
        entry: ownership.claim(entry),
        dns_omitted,
    })
}

/// An entry policy gives a workload, and the DNS name templates left out of it for this
/// workload (each with why): a name Kubernetes accepts never costs a workload its identity.
#[derive(Debug)]
pub struct Rendered {
    pub entry: Entry,
    pub dns_omitted: Vec<String>,
}

/// Everything but the ID and hint, which only `Ownership::claim` sets: this value never
/// leaves the module unclaimed. `node_alias` gives the parent of a policy that leaves parentID unset, in a trust domain.
fn render_unclaimed(
    spec: &SpiffeRegistrationSpec,
    workload: &Workload,
    node_alias: &dyn Fn(&str) -> String,
) -> Result<Rendered, RenderError> {
    let td = spec.trust_domain.as_str();
    if !valid_trust_domain(td) {
        return Err(RenderError::TrustDomain(td.to_string()));
    }
    let parent_id = match &spec.parent_id {
        Some(parent_id) => {
            check(parent_id, td, false).map_err(RenderError::ParentId)?;
            parent_id.clone()
        }
        None => node_alias(td),
    };
    let template = spec
        .spiffe_id_template
        .as_deref()
        .unwrap_or(DEFAULT_SPIFFE_ID_TEMPLATE);
    let spiffe_id = fill(template, td, workload)?;
    check_template(template)?;
    check(&spiffe_id, td, true).map_err(RenderError::SpiffeId)?;
    let x509_svid_ttl = spec
        .ttl
        .as_deref()
        .map(|t| parse_ttl("ttl", t))
        .transpose()?
        .unwrap_or(0);
    let jwt_svid_ttl = spec
        .jwt_ttl
        .as_deref()
        .map(|t| parse_ttl("jwtTtl", t))
        .transpose()?
        .unwrap_or(0);
    let mut dns_names = Vec::with_capacity(spec.dns_names.len());
    let mut dns_omitted = Vec::new();
    for template in &spec.dns_names {
        match render_dns_name(template, td, workload)? {
            DnsName::Rendered(name) => dns_names.push(name),
            DnsName::Omitted(why) => dns_omitted.push(why),
        }
    }
    dns_names.sort();
    dns_names.dedup();
    let mut federates_with = spec.federates_with.clone();
    if let Some(bad) = federates_with
        .iter()
        .find(|t| !valid_trust_domain(t.strip_prefix("spiffe://").unwrap_or(t)))
    {
        return Err(RenderError::FederatesWith(bad.clone()));
    }
    federates_with.sort();
    federates_with.dedup();
    let mut selectors = vec![
        Selector::new("k8s", format!("ns:{}", workload.namespace)),
        Selector::new("k8s", format!("sa:{}", workload.service_account)),
    ];
    selectors.sort();
    let entry = Entry {
        id: String::new(),
        spiffe_id,
        parent_id,
        selectors,
        x509_svid_ttl,
        jwt_svid_ttl,
        dns_names,
        federates_with,
        hint: String::new(),
        revision_number: 0,
    };
    Ok(Rendered { entry, dns_omitted })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{mk_spec, ownership};

    const WL: Workload<'static> = Workload {
        namespace: "payments",
        service_account: "api",
    };

    #[test]
    fn default_template_renders_namespace_and_service_account() {
        let id = render(&mk_spec(), &WL, &ownership()).expect("valid").entry;
        assert_eq!(id.spiffe_id, "spiffe://example.org/ns/payments/sa/api");
        assert_eq!(id.parent_id, "spiffe://example.org/k8s/nodes");
        assert_eq!(
            id.selectors,
            vec![
                Selector::new("k8s", "ns:payments"),
                Selector::new("k8s", "sa:api")
            ]
        );
        assert_eq!((id.x509_svid_ttl, id.jwt_svid_ttl), (3600, 0));
    }

    #[test]
    fn an_unset_parent_is_the_node_alias_of_the_psat_cluster() {
        let spec = SpiffeRegistrationSpec {
            parent_id: None,
            ..mk_spec()
        };
        let ownership = ownership()
            .with_node_alias_cluster("bed")
            .expect("valid psat name");
        let entry = render(&spec, &WL, &ownership).expect("valid").entry;
        assert_eq!(
            entry.parent_id,
            "spiffe://example.org/spiffe-registrar/k8s-psat/bed"
        );
        assert!(ownership.node_alias_for(&entry.parent_id).is_some());
        assert_eq!(validate(&spec), Ok(()));
    }

    #[test]
    fn table_of_policy_errors() {
        type Edit = fn(&mut SpiffeRegistrationSpec);
        let cases: Vec<(&str, Edit, &str)> = vec![
            (
                "scheme in trust domain",
                |s| s.trust_domain = "spiffe://example.org".into(),
                "InvalidTrustDomain",
            ),
            (
                "parent in other domain",
                |s| s.parent_id = Some("spiffe://other.org/x".into()),
                "InvalidParentID",
            ),
            (
                "parent without path",
                |s| s.parent_id = Some("spiffe://example.org".into()),
                "InvalidParentID",
            ),
            (
                "unknown placeholder",
                |s| s.spiffe_id_template = Some("spiffe://{trustDomain}/{deployment}".into()),
                "InvalidSpiffeIDTemplate",
            ),
            (
                "unclosed placeholder",
                |s| s.spiffe_id_template = Some("spiffe://{trustDomain}/{namespace".into()),
                "InvalidSpiffeIDTemplate",
            ),
            (
                "reserved path",
                |s| s.spiffe_id_template = Some("spiffe://{trustDomain}/spire/{namespace}".into()),
                "InvalidSpiffeIDTemplate",
            ),
            (
                "template in other domain",
                |s| s.spiffe_id_template = Some("spiffe://evil.org/{namespace}".into()),
                "InvalidSpiffeIDTemplate",
            ),
            (
                "ttl too short",
                |s| s.ttl = Some("10s".into()),
                "InvalidTTL",
            ),
            (
                "jwt ttl garbage",
                |s| s.jwt_ttl = Some("soon".into()),
                "InvalidTTL",
            ),
            (
                "namespace not a whole segment",
                |s| {
                    s.spiffe_id_template =
                        Some("spiffe://{trustDomain}/ns-{namespace}/{serviceAccount}".into())
                },
                "InvalidSpiffeIDTemplate",
            ),
            (
                "service account missing",
                |s| s.spiffe_id_template = Some("spiffe://{trustDomain}/ns/{namespace}".into()),
                "InvalidSpiffeIDTemplate",
            ),
            (
                "namespace twice",
                |s| {
                    s.spiffe_id_template = Some(
                        "spiffe://{trustDomain}/{namespace}/{serviceAccount}/{namespace}".into(),
                    )
                },
                "InvalidSpiffeIDTemplate",
            ),
            (
                "placeholder inside a DNS label",
                |s| s.dns_names = vec!["api-{namespace}.svc".into()],
                "InvalidDNSName",
            ),
            (
                "dns name",
                |s| s.dns_names = vec!["bad_name.{namespace}".into()],
                "InvalidDNSName",
            ),
            (
                "federation",
                |s| s.federates_with = vec!["Bad Domain".into()],
                "InvalidFederatesWith",
            ),
        ];
        for (what, edit, reason) in cases {
            let mut spec = mk_spec();
            edit(&mut spec);
            let error = render(&spec, &WL, &ownership()).expect_err(what);
            assert_eq!(error.reason(), reason, "{what}: {error}");
            assert_eq!(
                validate(&spec).map_err(|e| e.reason()),
                Err(reason),
                "{what}"
            );
        }
    }

    #[test]
    fn custom_template_dns_names_and_federation_are_normalized() {
        let mut spec = mk_spec();
        spec.spiffe_id_template =
            Some("spiffe://{trustDomain}/k8s/{namespace}/{serviceAccount}".into());
        spec.dns_names = vec![
            "{serviceAccount}.{namespace}.svc".into(),
            "a.example".into(),
            "a.example".into(),
        ];
        spec.federates_with = vec!["z.org".into(), "a.org".into()];
        spec.jwt_ttl = Some("5m".into());
        let id = render(&spec, &WL, &ownership()).expect("valid").entry;
        assert_eq!(id.spiffe_id, "spiffe://example.org/k8s/payments/api");
        assert_eq!(
            id.dns_names,
            vec!["a.example".to_string(), "api.payments.svc".to_string()]
        );
        assert_eq!(
            id.federates_with,
            vec!["a.org".to_string(), "z.org".to_string()]
        );
        assert_eq!(id.jwt_svid_ttl, 300);
    }

    #[test]
    fn a_dotted_service_account_gets_its_entry_without_the_dns_name_it_cannot_fill() {
        let mut spec = mk_spec();
        spec.dns_names = vec![
            "{serviceAccount}.{namespace}.svc".into(),
            "{namespace}.svc".into(),
        ];
        let wl = Workload {
            namespace: "payments",
            service_account: "evil.example.com",
        };
        let rendered = render(&spec, &wl, &ownership()).expect("the entry renders");
        assert_eq!(rendered.entry.dns_names, ["payments.svc"]);
        assert_eq!(rendered.dns_omitted.len(), 1, "{:?}", rendered.dns_omitted);
        assert!(
            rendered.dns_omitted[0].contains("{serviceAccount}.{namespace}.svc")
                && rendered.dns_omitted[0].contains("evil.example.com"),
            "the note names the template and the name: {:?}",
            rendered.dns_omitted
        );
        // The SPIFFE ID takes the dotted name as one segment.
        assert!(rendered.entry.spiffe_id.ends_with("/sa/evil.example.com"));
        // A name too long for a DNS label is left out the same way.
        let long = "a".repeat(64);
        let wl = Workload {
            namespace: "payments",
            service_account: &long,
        };
        let rendered = render(&spec, &wl, &ownership()).expect("the entry renders");
        assert_eq!(rendered.entry.dns_names, ["payments.svc"]);
        assert_eq!(rendered.dns_omitted.len(), 1);
        // An ordinary name renders every DNS name and omits nothing.
        let rendered = render(&spec, &WL, &ownership()).expect("valid");
        assert_eq!(rendered.entry.dns_names.len(), 2);
        assert!(rendered.dns_omitted.is_empty());
    }

    #[test]
    fn the_rust_template_check_matches_the_crd_rule_on_samples() {
        for good in [
            "spiffe://{trustDomain}/ns/{namespace}/sa/{serviceAccount}",
            "spiffe://example.org/{namespace}/{serviceAccount}",
            "spiffe://{trustDomain}/k8s/{namespace}/x/{serviceAccount}/workload",
        ] {
            assert!(check_template(good).is_ok(), "{good}");
        }
        for bad in [
            "spiffe://{trustDomain}/{serviceAccount}/{namespace}",
            "spiffe://{trustDomain}/{namespace}{serviceAccount}",
            "spiffe://{trustDomain}/ns/{namespace}.x/{serviceAccount}",
            "spiffe://{trustDomain}/{trustDomain}/{namespace}/{serviceAccount}",
            "http://{trustDomain}/{namespace}/{serviceAccount}",
        ] {
            assert!(check_template(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_service_account_name_cannot_escape_its_path_segment() {
        // Kubernetes names cannot contain '/', but a template must never turn odd input into a
        // different valid identity: '..' is rejected as a segment.
        let wl = Workload {
            namespace: "payments",
            service_account: "..",
        };
        assert!(matches!(
            render(&mk_spec(), &wl, &ownership()),
            Err(RenderError::SpiffeId(_))
        ));
    }
}
