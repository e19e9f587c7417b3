//! The user docs are held to the product: the flag reference is the binary's own `--help`,
//! the architecture's module map names every source file, the README stays an overview, and
//! no user-facing text tells development history.

use std::path::Path;
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// What each generated block holds: the command's arguments after the binary.
const GENERATED: &[&[&str]] = &[&["run", "--help"], &["uninstall", "--help"]];

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The binary's help, with an empty environment so that no `[env: X=value]` leaks in.
fn help(args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_spiffe-registrar"))
        .args(args)
        .env_clear()
        .output()
        .expect("the binary runs");
    assert!(output.status.success(), "{args:?}: {output:?}");
    String::from_utf8(output.stdout).expect("help is UTF-8")
}

/// `text` with each generated block replaced by what the binary prints now.
fn regenerated(text: &str) -> String {
    let mut out = text.to_string();
    for args in GENERATED {
        let marker = format!("<!-- generated: spiffe-registrar {} -->", args.join(" "));
        let start = out
            .find(&marker)
            .unwrap_or_else(|| panic!("docs/reference.md lacks {marker}"));
        let end = out[start..]
            .find("<!-- end generated -->")
            .map(|at| start + at)
            .expect("every generated block ends");
        let block = format!("{marker}\n```text\n{}```\n", help(args));
        out.replace_range(start..end, &block);
    }
    out
}

#[test]
fn the_flag_reference_is_the_binarys_own_help() {
    let path = Path::new(ROOT).join("docs/reference.md");
    let text = read("docs/reference.md");
    let wanted = regenerated(&text);
    if std::env::var_os("REGENERATE_DOCS").is_some() {
        std::fs::write(&path, &wanted).expect("docs/reference.md is writable");
        return;
    }
    assert!(
        text == wanted,
        "docs/reference.md's flags differ from the binary's --help; regenerate with \
         REGENERATE_DOCS=1 cargo test --test docs"
    );
    assert!(
        text.contains("--node-alias-cluster"),
        "the blocks hold the flags"
    );
}

fn rust_files(dir: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).expect("readable") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let relative = path.strip_prefix(ROOT).expect("under the root");
            out.push(relative.to_string_lossy().into_owned());
        }
    }
}

#[test]
fn the_module_map_lists_every_source_file() {
    let map = read("docs/architecture.md");
    let mut files = Vec::new();
    rust_files(&Path::new(ROOT).join("src"), &mut files);
    files.sort();
    let missing: Vec<&String> = files
        .iter()
        .filter(|f| !map.contains(&format!("`{f}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/architecture.md's module map does not list: {missing:?}"
    );
    assert!(files.len() > 80, "{} files", files.len());
}

#[test]
fn the_readme_is_an_overview_that_links_the_docs() {
    let readme = read("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= 200,
        "README.md has {lines} lines; details belong in docs/"
    );
    for doc in [
        "install",
        "policy",
        "reference",
        "operations",
        "architecture",
        "development",
        "benchmarks",
    ] {
        let path = format!("docs/{doc}.md");
        assert!(
            readme.contains(&format!("({path})")),
            "README.md links {path}"
        );
        assert!(Path::new(ROOT).join(&path).exists(), "{path} exists");
    }
}

#[test]
fn user_facing_text_tells_the_product_not_its_history() {
    let mut texts = vec!["README.md".to_string()];
    for entry in std::fs::read_dir(Path::new(ROOT).join("docs")).expect("docs/ exists") {
        let name = entry.expect("an entry").file_name();
        texts.push(format!("docs/{}", name.to_string_lossy()));
    }
    for path in texts {
        let text = read(&path).to_lowercase();
        for word in ["session ", "sessions ", "phase ", "issue "] {
            assert!(
                !text.contains(word),
                "{path} speaks of development history ({word:?}): history lives in git"
            );
        }
    }
}
