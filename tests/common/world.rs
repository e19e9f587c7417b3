//! A cluster test's world in a few lines: the CRD and webhook configuration on a control plane,
//! a policy per test that selects only that test's namespaces, Deployments, and the questions
//! tests ask of the apiserver (annotations, conditions, Events) and of the registrar (metrics).

use super::k8s::{
    annotation, create_namespace_with, create_webhook_configuration_excluding, deployment,
    eventually, install_crd, policy,
};
use super::kube_plane::{KubePlane, client_for};
use super::paths::free_port;
use super::process::{http_get, run};
use super::registrar::{Options, Registrar};
use super::spire::SpireServer;
use super::stack::{Held, Stack, unique};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use spiffe_registrar::names::ENTRY_ID_ANNOTATION;
use spiffe_registrar::policy::SpiffeRegistration;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

pub const TD: &str = "example.org";
/// The registrar's own namespace (Secret, Lease).
pub const HOME: &str = "registrar-system";
pub const WEBHOOK_CONFIG: &str = "spiffe-registrar-e2e";
/// Namespaces with this label are not sent to the webhook (as if it were not installed).
pub const NO_WEBHOOK: &str = "e2e/no-webhook";
pub const WAIT: Duration = Duration::from_secs(60);

/// CRD, the registrar's namespace and a webhook configuration pointing at `webhook_port`.
pub fn prepare(kube: &KubePlane, webhook_port: u16) {
    let kubeconfig = kube.kubeconfig.clone();
    Stack::block_on_fresh(async move {
        let client = client_for(&kubeconfig).await;
        install_crd(&client).await;
        create_namespace_with(&client, HOME, false, &[]).await;
        create_webhook_configuration_excluding(
            &client,
            WEBHOOK_CONFIG,
            webhook_port,
            Some(NO_WEBHOOK),
        )
        .await;
    });
}

/// Registrar flags: `defaults`, with each flag that `extra` also sets taken from `extra`.
pub fn flags(defaults: &[&str], extra: &[&str]) -> Vec<String> {
    let flag = |arg: &str| arg.split('=').next().unwrap_or_default().to_string();
    let overridden: Vec<String> = extra.iter().map(|a| flag(a)).collect();
    defaults
        .iter()
        .filter(|a| !overridden.contains(&flag(a)))
        .chain(extra)
        .map(ToString::to_string)
        .collect()
}

/// A registrar of this world (its Secret and Lease in `HOME`, `WEBHOOK_CONFIG`) in cluster
/// `cluster`, logging as `name`, with `flags`.
pub fn options<'a>(cluster: &'a str, name: &'a str, flags: Vec<String>) -> Options<'a> {
    Options {
        namespace: HOME,
        webhook_configuration: WEBHOOK_CONFIG,
        cluster_name: cluster,
        name,
        extra_args: flags,
        extra_env: vec![],
    }
}

/// Starts a registrar on `stack`, serving the webhook on `port` (the one the webhook
/// configuration names) when given, and hands it to the sentinel.
pub fn launch(stack: &Stack, port: Option<u16>, options: Options) -> Registrar {
    let registrar = tokio::task::block_in_place(|| match port {
        Some(port) => Registrar::start_on(stack, port, options),
        None => Registrar::start(stack, options),
    });
    stack.track(registrar.process.pgid());
    registrar
}

/// A test binary's shared stack and the one registrar its tests share, started on first use.
pub struct Suite {
    pub stack: &'static Stack,
    pub registrar: Registrar,
}

/// What a test holds while it runs: its suite, and a guard that prints the peers' and the
/// registrar's logs if the test fails.
pub type InSuite = Held<Suite>;

impl Suite {
    /// The suite kept in `cell`: the shared stack prepared by `prepare` (CRD, home namespace,
    /// webhook configuration) and a registrar with `options` on the webhook's port, started
    /// by the first test that asks.
    pub fn get(
        cell: &'static OnceLock<Suite>,
        options: impl FnOnce() -> Options<'static>,
    ) -> InSuite {
        Self::get_prepared(cell, |stack, port| prepare(&stack.kube, port), options)
    }

    /// `get` with a preparation of the suite's own.
    pub fn get_prepared(
        cell: &'static OnceLock<Suite>,
        prepare: impl FnOnce(&'static Stack, u16),
        options: impl FnOnce() -> Options<'static>,
    ) -> InSuite {
        let suite = tokio::task::block_in_place(|| {
            cell.get_or_init(|| {
                let stack = Stack::shared();
                let port = free_port();
                prepare(stack, port);
                let registrar = Registrar::start_on(stack, port, options());
                stack.track(registrar.process.pgid());
                Suite { stack, registrar }
            })
        });
        Held::new(suite, suite.stack)
    }

    /// The SPIRE server's admin socket.
    pub fn socket(&self) -> &Path {
        &self.stack.spire_server.socket
    }
}

/// A stack of its own, prepared (the returned port is the webhook configuration's), for
/// tests that stop SPIRE, run several replicas or crash the registrar.
pub fn own_plane() -> (Stack, u16) {
    tokio::task::block_in_place(|| {
        let stack = Stack::start();
        let port = free_port();
        prepare(&stack.kube, port);
        (stack, port)
    })
}

/// The SPIFFE ID the default template gives `ns`/`sa`.
pub fn spiffe_id(ns: &str, sa: &str) -> String {
    format!("spiffe://{TD}/ns/{ns}/sa/{sa}")
}

/// The ID of an entry as the spire-server CLI prints it.
pub fn entry_id(entry: &Value) -> String {
    entry["id"].as_str().expect("entry id").to_string()
}

impl SpireServer {
    /// Every entry (any writer) with SPIFFE ID `id`, read with the spire-server CLI.
    pub fn entries_for(&self, id: &str) -> Vec<Value> {
        self.entries(&["-spiffeID", id])
    }

    /// Waits until SPIRE holds no entry with SPIFFE ID `id`.
    pub async fn wait_none_for(&self, id: &str) {
        let what = format!("no SPIRE entry for {id}");
        eventually(&what, WAIT, || async {
            self.entries_for(id).is_empty().then_some(())
        })
        .await
    }
}

/// Who holds the registrar's Lease in `HOME` (`None` when nobody, or no Lease yet).
pub async fn lease_holder(client: &Client) -> Option<String> {
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), HOME);
    leases
        .get_opt(spiffe_registrar::leader::LEASE_NAME)
        .await
        .ok()
        .flatten()?
        .spec?
        .holder_identity
        .filter(|h| !h.is_empty())
}

/// One test's world: policies selecting namespaces labelled `e2e/test=<tag>`.
pub struct Scenario {
    pub client: Client,
    pub tag: String,
    pub kubeconfig: std::path::PathBuf,
}

impl Scenario {
    pub async fn new(kube: &KubePlane) -> Self {
        Self {
            client: kube.client().await,
            tag: unique("t"),
            kubeconfig: kube.kubeconfig.clone(),
        }
    }

    /// The parent ID this test's policies use by default.
    pub fn parent(&self, suffix: &str) -> String {
        format!("spiffe://{TD}/k8s/{}/{suffix}", self.tag)
    }

    /// A valid spec selecting this test's namespaces, with parent `parent(suffix)`.
    pub fn spec(&self, suffix: &str) -> Value {
        json!({
            "trustDomain": TD,
            "parentID": self.parent(suffix),
            "ttl": "1h",
            "namespaceSelector": { "matchLabels": { "e2e/test": self.tag } }
        })
    }

    /// Creates policy `<tag>-<suffix>` from `spec`; the apiserver's error when it refuses.
    pub async fn try_policy(&self, suffix: &str, spec: Value) -> Result<String, kube::Error> {
        let name = format!("{}-{suffix}", self.tag);
        self.policies()
            .create(&PostParams::default(), &policy(&name, spec))
            .await?;
        Ok(name)
    }

    pub async fn policy(&self, suffix: &str, spec: Value) -> String {
        self.try_policy(suffix, spec)
            .await
            .expect("the policy must be accepted")
    }

    /// This test's policy `<tag>-p`, valid, parent `parent("p")`, 1h TTL.
    pub async fn default_policy(&self) -> String {
        self.policy("p", self.spec("p")).await
    }

    pub async fn patch_policy(&self, name: &str, patch: Value) {
        self.policies()
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("policy patch");
    }

    /// A new namespace selected by this test's policies (and sent to the webhook if `webhook`).
    pub async fn namespace(&self, webhook: bool) -> String {
        let name = unique(&self.tag);
        let mut labels = vec![("e2e/test", self.tag.as_str())];
        if !webhook {
            labels.push((NO_WEBHOOK, "true"));
        }
        create_namespace_with(&self.client, &name, true, &labels).await;
        name
    }

    pub fn deployments(&self, ns: &str) -> Api<Deployment> {
        Api::namespaced(self.client.clone(), ns)
    }

    pub fn policies(&self) -> Api<SpiffeRegistration> {
        Api::all(self.client.clone())
    }

    /// Creates Deployment `name` running as `sa` in `ns` and waits for its entry-id.
    pub async fn registered(&self, ns: &str, name: &str, sa: &str) -> String {
        self.deployments(ns)
            .create(&PostParams::default(), &deployment(name, Some(sa)))
            .await
            .expect("create");
        entry_id_of(&self.deployments(ns), name).await
    }

    /// Deletes Deployment `ns/name` and waits until it is gone (its finalizer released).
    pub async fn delete_deployment(&self, ns: &str, name: &str) {
        let api = self.deployments(ns);
        api.delete(name, &kube::api::DeleteParams::default())
            .await
            .expect("delete");
        gone(&api, name).await;
    }

    /// Waits for condition `type_` of policy `name` to satisfy `pred`.
    pub async fn condition(
        &self,
        name: &str,
        type_: &str,
        pred: impl Fn(&Condition) -> bool,
    ) -> Condition {
        let what = format!("condition {type_} of {name}");
        eventually(&what, WAIT, || async {
            let p = self.policies().get(name).await.ok()?;
            p.status?
                .conditions
                .into_iter()
                .find(|c| c.type_ == type_ && pred(c))
        })
        .await
    }

    /// Waits for an Event with `reason` about object `name` in `ns` ("default" for policies).
    pub async fn event(&self, ns: &str, name: &str, reason: &str) -> Event {
        let what = format!("a {reason} Event on {ns}/{name}");
        eventually(&what, WAIT, || async {
            events(&self.client, ns, name, reason)
                .await
                .into_iter()
                .next()
        })
        .await
    }

    /// `kubectl` against this world's apiserver, as `--as` when given; (ok, stdout, stderr).
    pub fn kubectl(&self, args: &[&str]) -> (bool, String, String) {
        run(super::kube_plane::kubectl_command(&self.kubeconfig).args(args))
    }
}

/// Waits until the Deployment records an entry ID and returns it.
pub async fn entry_id_of(api: &Api<Deployment>, name: &str) -> String {
    eventually(&format!("{name} to be registered"), WAIT, || async {
        let d = api.get(name).await.ok()?;
        annotation(&d, ENTRY_ID_ANNOTATION).map(str::to_string)
    })
    .await
}

pub async fn gone(api: &Api<Deployment>, name: &str) {
    eventually(&format!("{name} to be gone"), WAIT, || async {
        api.get_opt(name).await.ok()?.is_none().then_some(())
    })
    .await
}

pub async fn events(client: &Client, ns: &str, name: &str, reason: &str) -> Vec<Event> {
    let Ok(list) = Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default().fields(&format!("involvedObject.name={name}")))
        .await
    else {
        return Vec::new();
    };
    list.items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .collect()
}

impl Registrar {
    /// The sum of metric `name` (without the exported `spiffe_registrar_` namespace) over the
    /// series carrying `labels`.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let name = format!("{}_{name}", spiffe_registrar::telemetry::METRIC_NAMESPACE);
        let text = http_get(self.admin_port, "/metrics").unwrap_or_default();
        text.lines()
            .filter(|line| !line.starts_with('#'))
            .filter_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
                (metric == name
                    && labels
                        .iter()
                        .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\""))))
                .then(|| value.parse::<f64>().ok())?
            })
            // From +0: an empty `sum` of floats is -0, which reports print as "-0".
            .fold(0.0, |all, value| all + value)
    }

    /// SPIRE Entry API calls made so far (every operation, every result).
    pub fn spire_calls(&self) -> f64 {
        self.metric("spire_api_call_duration_seconds_count", &[])
    }

    /// SPIRE Entry API calls that did not return OK (each attempt counts).
    pub fn failed_spire_calls(&self) -> f64 {
        let calls = "spire_api_call_duration_seconds_count";
        self.metric(calls, &[]) - self.metric(calls, &[("code", "Ok")])
    }

    /// SPIRE list calls so far: full lists happen at start and on each resync only.
    pub fn spire_list_calls(&self) -> f64 {
        self.metric("spire_api_call_duration_seconds_count", &[("op", "list")])
    }

    /// Completed syncs so far.
    pub fn syncs(&self) -> f64 {
        self.metric("reconcile_duration_seconds_count", &[])
    }

    /// Waits until `n` more syncs than `before` have completed.
    pub async fn wait_syncs(&self, before: f64, n: f64) {
        eventually("more syncs", WAIT, || async {
            (self.syncs() >= before + n).then_some(())
        })
        .await
    }
}
