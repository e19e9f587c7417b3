//! The shape of the code, held to what `src/lib.rs` states: every module imports only from
//! its own layer or the layers below, no two modules import each other (directly or round a
//! longer cycle), the pure decisions do no I/O, functions stay short and the controller's
//! files small. Read from the source with `syn`; test code (`#[cfg(test)]`) is left out of
//! the import rules, since tests may reach anything.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use syn::visit::Visit;

/// Layers, lowest first: (module path prefix, layer). A module belongs to the longest prefix
/// that matches it. Across top-level modules, imports go strictly downward; within one, to
/// the same layer or below.
const LAYERS: &[(&str, u32)] = &[
    ("names", 0),
    ("version", 0),
    ("metadata_patch", 0),
    ("supervise", 0),
    ("telemetry", 0),
    ("spire", 10),
    ("keys", 15),
    ("policy", 20),
    ("index", 30),
    ("certs", 30),
    ("leader", 30),
    // The controller, from its pure core out to its wiring.
    ("controller", 40),
    ("controller::metrics", 40),
    ("controller::desired", 41),
    ("controller::decide", 42),
    ("controller::status", 43),
    ("controller::policy_notes", 43),
    ("controller::pace", 43),
    ("controller::failpoint", 43),
    ("controller::spire_health", 44),
    ("controller::view", 44),
    ("controller::events", 44),
    ("controller::record", 45),
    ("controller::writer", 46),
    ("controller::policy_effects", 47),
    ("controller::state", 48),
    ("controller::health", 49),
    ("controller::sync", 49),
    ("controller::apply", 49),
    ("controller::leading", 50),
    ("controller::preview", 50),
    ("webhook", 40),
    ("config", 60),
    ("run", 70),
    ("uninstall", 80),
];

/// Modules that decide and must not do I/O: no client, runtime or network crate.
const PURE: &[&str] = &[
    "controller::desired",
    "controller::decide",
    "controller::status",
    "controller::policy_notes",
    "controller::pace",
    "controller::spire_health",
    "policy",
    "keys",
];
const IO_CRATES: &[&str] = &["tokio", "tonic", "hyper", "axum", "reqwest"];

/// Functions longer than this many lines are split into named steps...
const MAX_FN_LINES: usize = 80;
/// ...except tables, whose length is their content: (module, function).
const TABLES: &[(&str, &str)] = &[
    // One registration per metric, each with its help text.
    ("controller::metrics", "register"),
    // The test table of rendering cases.
    ("policy::render::tests", "table_of_policy_errors"),
];

/// No file under `src/controller/` is longer than this.
const MAX_CONTROLLER_FILE_LINES: usize = 400;

struct Module {
    /// `a::b` for `src/a/b.rs` or `src/a/b/mod.rs`; empty for `src/lib.rs`.
    path: String,
    file: PathBuf,
    syntax: syn::File,
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn module_path(file: &Path) -> String {
    let relative = file.strip_prefix(src()).expect("under src");
    let mut parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts.join("::")
}

/// Every module of the library (the binary's `main.rs` is a crate of its own).
fn modules() -> Vec<Module> {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    files.sort();
    files
        .into_iter()
        .filter(|f| !f.ends_with("main.rs"))
        .map(|file| {
            let text = std::fs::read_to_string(&file).expect("readable source");
            let syntax =
                syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            Module {
                path: module_path(&file),
                file,
                syntax,
            }
        })
        .collect()
}

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.parse_args::<syn::Meta>()
                .is_ok_and(|m| m.path().is_ident("test"))
    })
}

/// Modules that exist only under `#[cfg(test)]` (declared `#[cfg(test)] mod x;`).
fn test_modules(modules: &[Module]) -> BTreeSet<String> {
    let mut tests = BTreeSet::new();
    for module in modules {
        for item in &module.syntax.items {
            if let syn::Item::Mod(m) = item
                && is_cfg_test(&m.attrs)
            {
                tests.insert(join(&module.path, &m.ident.to_string()));
            }
        }
    }
    tests
}

fn join(parent: &str, child: &str) -> String {
    if parent.is_empty() {
        child.to_string()
    } else {
        format!("{parent}::{child}")
    }
}

fn under(module: &str, prefix: &str) -> bool {
    module == prefix || module.starts_with(&format!("{prefix}::"))
}

/// The paths a module's non-test code names, made absolute (`crate::`, `super::`, `self::`),
/// and the names it re-exports (`pub use`), by name.
#[derive(Default)]
struct Uses {
    module: String,
    paths: Vec<Vec<String>>,
    reexports: BTreeMap<String, Vec<String>>,
    /// Names brought into scope by `use` (a module imported as `decide`, then named
    /// `decide::x`), and the child modules declared here.
    aliases: BTreeMap<String, Vec<String>>,
    external: BTreeSet<String>,
}

impl Uses {
    fn absolute(&self, segments: &[String]) -> Option<Vec<String>> {
        let mut base: Vec<String> = self
            .module
            .split("::")
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        let mut rest = segments;
        match rest.first().map(String::as_str) {
            Some("crate") => {
                base.clear();
                rest = &rest[1..];
            }
            Some("self") => rest = &rest[1..],
            Some("super") => {
                while rest.first().map(String::as_str) == Some("super") {
                    base.pop();
                    rest = &rest[1..];
                }
            }
            Some(first) => {
                let aliased = self.aliases.get(first)?;
                base = aliased.clone();
                rest = &rest[1..];
            }
            None => return None,
        }
        base.extend(rest.iter().cloned());
        Some(base)
    }

    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree, public: bool) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree, public);
                prefix.pop();
            }
            syn::UseTree::Name(n) => self.used(prefix, &n.ident.to_string(), None, public),
            syn::UseTree::Rename(r) => self.used(
                prefix,
                &r.ident.to_string(),
                Some(r.rename.to_string()),
                public,
            ),
            syn::UseTree::Glob(_) => self.used(prefix, "*", None, false),
            syn::UseTree::Group(g) => {
                for tree in &g.items {
                    self.use_tree(prefix, tree, public);
                }
            }
        }
    }

    fn used(&mut self, prefix: &[String], name: &str, rename: Option<String>, public: bool) {
        let mut segments = prefix.to_vec();
        if name != "self" && name != "*" {
            segments.push(name.to_string());
        }
        match self.absolute(&segments) {
            Some(path) => {
                if name != "*" {
                    let alias = rename.clone().unwrap_or_else(|| match name {
                        "self" => prefix.last().cloned().unwrap_or_default(),
                        _ => name.to_string(),
                    });
                    self.aliases.insert(alias, path.clone());
                }
                if public {
                    let alias = rename.unwrap_or_else(|| name.to_string());
                    self.reexports.insert(alias, path.clone());
                }
                self.paths.push(path);
            }
            None => {
                if let Some(first) = segments.first() {
                    self.external.insert(first.clone());
                }
            }
        }
    }
}

impl<'ast> Visit<'ast> for Uses {
    /// `pub(super)` names who may see an item, not what it uses.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        if !is_cfg_test(&item.attrs) {
            syn::visit::visit_item_mod(self, item);
        }
    }

    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        if !is_cfg_test(&item.attrs) {
            syn::visit::visit_item_fn(self, item);
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        if is_cfg_test(&item.attrs) {
            return;
        }
        let public = matches!(item.vis, syn::Visibility::Public(_));
        self.use_tree(&mut Vec::new(), &item.tree, public);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        match self.absolute(&segments) {
            Some(path) => self.paths.push(path),
            None if segments.len() > 1 => {
                self.external.insert(segments[0].clone());
            }
            None => {}
        }
        syn::visit::visit_path(self, path);
    }
}

/// The graph of the library's non-test modules: module → modules it names.
struct Graph {
    edges: BTreeMap<String, BTreeSet<String>>,
    external: BTreeMap<String, BTreeSet<String>>,
}

fn graph() -> Graph {
    let modules = modules();
    let tests = test_modules(&modules);
    let is_test = |m: &str| tests.iter().any(|t| under(m, t));
    let known: BTreeSet<String> = modules.iter().map(|m| m.path.clone()).collect();
    let mut uses: BTreeMap<String, Uses> = BTreeMap::new();
    for module in modules.iter().filter(|m| !is_test(&m.path)) {
        let mut found = Uses {
            module: module.path.clone(),
            ..Uses::default()
        };
        for item in &module.syntax.items {
            if let syn::Item::Mod(m) = item {
                let child = join(&module.path, &m.ident.to_string());
                let path = child.split("::").map(String::from).collect();
                found.aliases.insert(m.ident.to_string(), path);
            }
        }
        found.visit_file(&module.syntax);
        uses.insert(module.path.clone(), found);
    }
    // The module a path lands in, following re-exports.
    let resolve = |path: &[String]| -> Option<String> {
        let mut path = path.to_vec();
        for _ in 0..8 {
            let (depth, module) = (0..=path.len())
                .rev()
                .map(|n| (n, path[..n].join("::")))
                .find(|(_, m)| known.contains(m))?;
            let next = path.get(depth);
            match next.and_then(|name| uses.get(&module)?.reexports.get(name)) {
                Some(target) if target != &path => {
                    let mut followed = target.clone();
                    followed.extend(path[depth + 1..].iter().cloned());
                    path = followed;
                }
                _ => return Some(module),
            }
        }
        None
    };
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut external = BTreeMap::new();
    // `lib.rs` only declares the modules.
    for (module, found) in uses.iter().filter(|(m, _)| !m.is_empty()) {
        let targets = edges.entry(module.clone()).or_default();
        for path in &found.paths {
            if let Some(target) = resolve(path).filter(|t| t != module && !t.is_empty()) {
                targets.insert(target);
            }
        }
        external.insert(module.clone(), found.external.clone());
    }
    Graph { edges, external }
}

fn layer(module: &str) -> (&'static str, u32) {
    LAYERS
        .iter()
        .filter(|(prefix, _)| under(module, prefix))
        .max_by_key(|(prefix, _)| prefix.len())
        .map(|(prefix, layer)| (*prefix, *layer))
        .unwrap_or_else(|| panic!("module {module} is in no layer: add it to LAYERS"))
}

fn top(module: &str) -> &str {
    module.split("::").next().unwrap_or(module)
}

#[test]
fn every_import_points_down_a_layer() {
    let graph = graph();
    let mut upward = Vec::new();
    for (module, targets) in &graph.edges {
        let (_, from) = layer(module);
        for target in targets {
            let (_, to) = layer(target);
            // A module's facade re-exports its own children, whatever their layer.
            let allowed = if under(target, module) {
                true
            } else if top(module) == top(target) {
                to <= from
            } else {
                to < from
            };
            if !allowed {
                upward.push(format!("{module} ({from}) imports {target} ({to})"));
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports against the layers:\n{}",
        upward.join("\n")
    );
}

#[test]
fn no_modules_import_each_other() {
    let graph = graph();
    // Depth-first search for back edges: every cycle has one.
    let mut cycles = Vec::new();
    let mut done: BTreeSet<&str> = BTreeSet::new();
    for start in graph.edges.keys() {
        let mut stack: Vec<&str> = Vec::new();
        find_cycles(&graph.edges, start, &mut stack, &mut done, &mut cycles);
    }
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

fn find_cycles<'g>(
    edges: &'g BTreeMap<String, BTreeSet<String>>,
    module: &'g str,
    stack: &mut Vec<&'g str>,
    done: &mut BTreeSet<&'g str>,
    cycles: &mut Vec<String>,
) {
    if done.contains(module) {
        return;
    }
    if let Some(at) = stack.iter().position(|m| *m == module) {
        let mut cycle: Vec<&str> = stack[at..].to_vec();
        cycle.push(module);
        cycles.push(cycle.join(" → "));
        return;
    }
    stack.push(module);
    for target in edges.get(module).into_iter().flatten() {
        find_cycles(edges, target, stack, done, cycles);
    }
    stack.pop();
    done.insert(module);
}

#[test]
fn the_decisions_do_no_io() {
    let graph = graph();
    let mut impure = Vec::new();
    for (module, crates) in &graph.external {
        if !PURE.iter().any(|p| under(module, p)) {
            continue;
        }
        for krate in crates.iter().filter(|c| IO_CRATES.contains(&c.as_str())) {
            impure.push(format!("{module} uses {krate}"));
        }
        for target in &graph.edges[module] {
            let (_, to) = layer(target);
            if top(target) == "controller" && to >= layer("controller::view").1 {
                impure.push(format!("{module} imports {target}, which does I/O"));
            }
        }
    }
    assert!(impure.is_empty(), "{}", impure.join("\n"));
}

/// Functions (free, methods, trait defaults) with their length in lines, by module.
struct Lengths {
    module: String,
    found: Vec<(String, String, usize)>,
}

impl Lengths {
    fn note(&mut self, name: &syn::Ident, block: &syn::Block) {
        use syn::spanned::Spanned;
        let span = block.span();
        let lines = span.end().line - span.start().line + 1;
        self.found
            .push((self.module.clone(), name.to_string(), lines));
    }
}

impl<'ast> Visit<'ast> for Lengths {
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        let outer = self.module.clone();
        self.module = join(&outer, &item.ident.to_string());
        syn::visit::visit_item_mod(self, item);
        self.module = outer;
    }
    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        self.note(&item.sig.ident, &item.block);
        syn::visit::visit_item_fn(self, item);
    }
    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        self.note(&item.sig.ident, &item.block);
        syn::visit::visit_impl_item_fn(self, item);
    }
    fn visit_trait_item_fn(&mut self, item: &'ast syn::TraitItemFn) {
        if let Some(block) = &item.default {
            self.note(&item.sig.ident, block);
        }
        syn::visit::visit_trait_item_fn(self, item);
    }
}

#[test]
fn functions_are_short_except_tables() {
    let mut long = Vec::new();
    let mut main = syn::parse_file(
        &std::fs::read_to_string(src().join("main.rs")).expect("main.rs is readable"),
    )
    .expect("main.rs parses");
    let mut all: Vec<(String, &mut syn::File)> = Vec::new();
    let mut modules = modules();
    for module in &mut modules {
        all.push((module.path.clone(), &mut module.syntax));
    }
    all.push(("main".to_string(), &mut main));
    for (module, syntax) in all {
        let mut lengths = Lengths {
            module,
            found: Vec::new(),
        };
        lengths.visit_file(syntax);
        for (module, name, lines) in lengths.found {
            let table = TABLES.iter().any(|(m, f)| *m == module && *f == name);
            if lines > MAX_FN_LINES && !table {
                long.push(format!("{module}::{name}: {lines} lines"));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines (split them into named steps):\n{}",
        long.join("\n")
    );
}

#[test]
fn controller_files_stay_small() {
    let big: Vec<String> = modules()
        .iter()
        .filter(|m| under(&m.path, "controller"))
        .filter_map(|m| {
            let lines = std::fs::read_to_string(&m.file).ok()?.lines().count();
            (lines > MAX_CONTROLLER_FILE_LINES).then(|| format!("{}: {lines}", m.file.display()))
        })
        .collect();
    assert!(
        big.is_empty(),
        "controller files over {MAX_CONTROLLER_FILE_LINES} lines:\n{}",
        big.join("\n")
    );
}

#[test]
fn the_check_sees_what_it_checks() {
    // The rules above pass vacuously if the graph is empty or misread.
    let graph = graph();
    let has = |from: &str, to: &str| graph.edges.get(from).is_some_and(|t| t.contains(to));
    assert!(
        has("controller::sync", "controller::decide::memory"),
        "re-exports are followed"
    );
    assert!(has("index::workload", "keys"), "crate:: paths are seen");
    assert!(
        has("controller::decide::spire_plan", "controller::decide::plan"),
        "super:: paths are seen"
    );
    assert!(graph.edges.len() > 60, "{} modules", graph.edges.len());
    assert!(graph.external["controller::leading"].contains("tokio"));
}
