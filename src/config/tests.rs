//! Config tests: parsing, the bound on every value, the shipped configs, and
//! the live-reload rules (whole file, only `[speculative]`, nothing cut off).

use super::*;

fn parse(s: &str) -> Result<Config, ConfigError> {
    Config::from_toml(s, Path::new("t.toml"))
}

#[test]
fn defaults_serve_the_real_pair_and_method_draft_needs_a_path() {
    let c = parse("").unwrap();
    assert!(c.draft.path.is_some());
    let mut c2 = c.clone();
    c2.draft.path = None;
    let e = c2.validate().unwrap_err().to_string();
    assert!(e.contains("draft.path"), "{e}");
    assert_eq!(c.server.port, 8000);
    // The default policy plans from the measured cost model.
    assert_eq!(
        c.speculative.policy().unwrap(),
        DraftPolicy::Goodput {
            max_k: 8,
            alpha: 0.3,
            initial_acceptance: 0.6,
            probe_every: 16
        }
    );
    let e = parse("[speculative.goodput]\nmax_k = 17")
        .unwrap_err()
        .to_string();
    assert!(e.contains("speculative.goodput.max_k"), "{e}");
    let e = parse("[speculative.goodput]\nalpha = 0")
        .unwrap_err()
        .to_string();
    assert!(e.contains("speculative.goodput.alpha"), "{e}");
}

#[test]
fn unknown_keys_and_bad_values_are_named() {
    let e = parse("[server]\nprot = 1").unwrap_err().to_string();
    assert!(e.contains("prot"), "{e}");
    let e = parse("[speculative]\nmethod = \"magic\"")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("speculative.method") && e.contains("'magic' is not one of draft, ngram, off"),
        "{e}"
    );
    let e = parse("[speculative]\npolicy = \"Fixed\"")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("speculative.policy") && e.contains("not one of fixed, table, adaptive"),
        "{e}"
    );
    // The same names as before the types: the TOML syntax did not change.
    let c = parse("[speculative]\nmethod = \"ngram\"\npolicy = \"adaptive\"").unwrap();
    assert_eq!(
        (c.speculative.method, c.speculative.policy),
        (SpeculativeMethod::Ngram, DraftPolicyKind::Adaptive)
    );
    assert_eq!(c.speculative.method.to_string(), "ngram");
    let e =
        parse("[speculative]\nmethod = \"ngram\"\npolicy = \"table\"\ntable = [[4, 1], [2, 3]]")
            .unwrap_err()
            .to_string();
    assert!(e.contains("speculative.table"), "{e}");
    let e = parse("[server]\nport = \"x\"").unwrap_err().to_string();
    assert!(e.contains("port"), "{e}");
    let e = parse("[speculative]\nmethod = \"off\"\n[scheduler]\nmax_num_seqs = 0")
        .unwrap_err()
        .to_string();
    assert!(e.contains("scheduler.max_num_seqs"), "{e}");
}

#[test]
fn adaptive_policy_from_toml() {
    let c = parse(
        "[speculative]\nmethod = \"ngram\"\npolicy = \"adaptive\"\nnum_tokens = 6\n[speculative.adaptive]\nalpha = 0.5",
    )
    .unwrap();
    match c.speculative.policy().unwrap() {
        DraftPolicy::Adaptive { max_k, alpha, .. } => assert_eq!((max_k, alpha), (6, 0.5)),
        p => panic!("{p:?}"),
    }
}

/// Each out-of-range value is refused with its key and the allowed range,
/// including values that the chosen policy does not use.
#[test]
fn every_number_is_bounded_and_errors_name_key_and_range() {
    let cases = [
        // The typo: a draft length of 300 in the table.
        (
            "[speculative]\npolicy = \"table\"\ntable = [[1, 300]]",
            "speculative.table",
            "0..=16",
        ),
        (
            "[speculative]\nmethod = \"ngram\"\nngram_max = 300",
            "speculative.ngram_max",
            "1..=16",
        ),
        (
            "[speculative]\nngram_min = 0",
            "speculative.ngram_min",
            "1..=16",
        ),
        (
            "[speculative]\nnum_tokens = 17",
            "speculative.num_tokens",
            "0..=16",
        ),
        // Unused by policy "table", still checked.
        (
            "[speculative.adaptive]\nalpha = 5.0",
            "speculative.adaptive.alpha",
            "(0, 1]",
        ),
        (
            "[speculative.adaptive]\nprobe_every = 100000",
            "speculative.adaptive.probe_every",
            "1..=1024",
        ),
        (
            "[speculative.adaptive]\ndraft_cost = 1e9",
            "speculative.adaptive.draft_cost",
            "0..=10",
        ),
        (
            "[speculative.adaptive]\nmin_k = 4",
            "speculative.adaptive.min_k",
            "0..=3",
        ),
        ("[kv]\nblock_size = 100000", "kv.block_size", "1..=256"),
        (
            "[server]\nmax_messages = 0",
            "server.max_messages",
            "1..=65536",
        ),
        (
            "[kv]\nnum_blocks = 5000000000",
            "kv.num_blocks",
            "0..=4194304",
        ),
        (
            "[kv]\nmemory_mib = 99999999",
            "kv.memory_mib",
            "1..=1048576",
        ),
        (
            "[server]\nmax_body_bytes = 100",
            "server.max_body_bytes",
            "1024..=67108864",
        ),
        (
            "[server]\nmax_concurrent_requests = 10000000",
            "server.max_concurrent_requests",
            "1..=65536",
        ),
        (
            "[server]\nmax_connections = 0",
            "server.max_connections",
            "1..=262144",
        ),
        (
            "[server]\nrequest_timeout_secs = 99999999",
            "server.request_timeout_secs",
            "1..=86400",
        ),
        (
            "[server]\ndrain_timeout_secs = 99999999",
            "server.drain_timeout_secs",
            "0..=3600",
        ),
        (
            "[server]\nkeep_alive_secs = 99999",
            "server.keep_alive_secs",
            "1..=600",
        ),
        (
            "[server]\nheader_read_timeout_secs = 0",
            "server.header_read_timeout_secs",
            "1..=300",
        ),
        (
            "[server]\nbody_read_timeout_secs = 0",
            "server.body_read_timeout_secs",
            "1..=3600",
        ),
        (
            "[server]\nstream_write_timeout_secs = 0",
            "server.stream_write_timeout_secs",
            "1..=3600",
        ),
        ("[server]\nhost = \"\"", "server.host", "1..=253"),
        ("[server]\napi_keys = [\"\"]", "server.api_keys", "1..=512"),
        (
            "[server]\napi_keys = [\"a b\"]",
            "server.api_keys",
            "1..=512",
        ),
        (
            "[server]\nserved_model_name = \"\"",
            "server.served_model_name",
            "1..=256",
        ),
        ("[model]\npath = \"\"", "model.path", "empty"),
        (
            "[model]\ntensor_parallel_size = 1000",
            "model.tensor_parallel_size",
            "1..=64",
        ),
        (
            "[model]\nmax_model_len = 0",
            "model.max_model_len",
            "1..=16777216",
        ),
        (
            "[model]\nchat_template = \"\"",
            "model.chat_template",
            "empty",
        ),
        ("[draft]\nhead_tokens = \"\"", "draft.head_tokens", "empty"),
        (
            "[scheduler]\nmax_num_seqs = 64\nmax_num_batched_tokens = 32",
            "scheduler.max_num_batched_tokens",
            "64..=1048576",
        ),
        (
            "[scheduler]\nmax_num_seqs = 100000",
            "scheduler.max_num_seqs",
            "1..=4096",
        ),
    ];
    for (text, key, range) in cases {
        let e = match parse(text) {
            Ok(_) => panic!("accepted: {text}"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(key) && e.contains(range), "{text}: {e}");
    }
    // The edges themselves are allowed.
    let c = parse(
        "[speculative]\nmethod = \"ngram\"\nnum_tokens = 16\nngram_min = 16\nngram_max = 16\n\
         table = [[1, 16]]\n[kv]\nblock_size = 256\nnum_blocks = 4194304\nmemory_mib = 0\n\
         [server]\ndrain_timeout_secs = 0\nport = 0",
    );
    c.unwrap();
}

/// The configs in configs/ parse and validate.
#[test]
fn shipped_configs_are_valid() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    for name in ["default.toml", "tiny.toml", "example-all.toml"] {
        Config::load(&dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// The file as the server started with it (method "draft", the default,
/// so that a file cut before `[speculative]` keeps the method).
const BASE: &str = "[server]\nport = 0\n\n[kv]\nnum_blocks = 64\n\n\
    [speculative]\nmethod = \"draft\"\npolicy = \"fixed\"\nnum_tokens = 12\nngram_min = 1\n";

/// Writes `text` to a file of its own and reloads it against `BASE`, with
/// the `[speculative]` in force being BASE's unless `in_force` says.
fn reload(
    name: &str,
    text: &str,
    in_force: Option<&SpeculativeConfig>,
) -> Result<SpeculativeReload, ConfigError> {
    let dir = std::env::temp_dir().join(format!("specgate-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    let base = parse(BASE).unwrap();
    let out = base.reload(&path, in_force.unwrap_or(&base.speculative));
    std::fs::remove_file(&path).unwrap();
    out
}

fn refusal(r: Result<SpeculativeReload, ConfigError>) -> String {
    match r {
        Ok(r) => panic!("applied: {}", r.summary()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn reload_applies_a_speculative_edit_and_says_what_changed() {
    let edited = BASE.replace("num_tokens = 12", "num_tokens = 5")
        + "ngram_max = 6\n[speculative.adaptive]\nalpha = 0.5\n";
    let r = reload("edit", &edited, None).unwrap();
    assert_eq!(r.policy, DraftPolicy::Fixed { k: 5 });
    assert_eq!(
        r.changes,
        [
            "speculative.num_tokens: 12 -> 5",
            "speculative.ngram_max: 4 -> 6",
            "speculative.adaptive.alpha: 0.3 -> 0.5",
        ]
    );
    assert_eq!(r.file, parse(&edited).unwrap());
    assert_eq!(r.speculative, r.file.speculative);
    // The same file again changes nothing; a key left out whose value stays
    // the same (ngram_min = 1 is the default) is no change either.
    let r = reload("same", &BASE.replace("ngram_min = 1\n", ""), None).unwrap();
    assert_eq!(r.summary(), "no change");
}

#[test]
fn reload_refuses_changes_outside_speculative_and_to_the_method() {
    let e = refusal(reload(
        "kv",
        &BASE.replace("num_blocks = 64", "num_blocks = 128"),
        None,
    ));
    assert!(e.contains("[kv] changed"), "{e}");
    let e = refusal(reload("port", &BASE.replace("port = 0", "port = 9"), None));
    assert!(e.contains("[server] changed"), "{e}");
    let e = refusal(reload(
        "method",
        &BASE.replace("method = \"draft\"", "method = \"ngram\""),
        None,
    ));
    assert!(e.contains("speculative.method"), "{e}");
    // A bad value anywhere refuses the whole file.
    let e = refusal(reload(
        "bad",
        &BASE.replace("num_tokens = 12", "num_tokens = 300"),
        None,
    ));
    assert!(
        e.contains("speculative.num_tokens") && e.contains("0..=16"),
        "{e}"
    );
}

/// A file cut short while being written parses, but must not bring back
/// defaults: cut before `[speculative]`, inside it, mid-number, or empty.
#[test]
fn reload_refuses_a_truncated_file() {
    let cut_before = &BASE[..BASE.find("[speculative]").unwrap()];
    let e = refusal(reload("before", cut_before, None));
    assert!(e.contains("speculative.num_tokens is missing"), "{e}");
    let cut_inside = &BASE[..BASE.find("num_tokens").unwrap()];
    let e = refusal(reload("inside", cut_inside, None));
    assert!(e.contains("speculative.num_tokens is missing"), "{e}");
    // `num_tokens = 12` cut to `num_tokens = 1`: valid TOML, wrong value.
    let cut_number = &BASE[..BASE.find("12").unwrap() + 1];
    let e = refusal(reload("number", cut_number, None));
    assert!(e.contains("newline"), "{e}");
    let e = refusal(reload("empty", "", None));
    assert!(e.contains("empty"), "{e}");
}

/// A method from the command line stays in force across reloads; the file
/// is compared with the file, not with the overridden settings.
#[test]
fn reload_keeps_the_method_in_force() {
    let mut in_force = parse(BASE).unwrap().speculative;
    in_force.method = SpeculativeMethod::Off;
    let r = reload(
        "cli",
        &BASE.replace("num_tokens = 12", "num_tokens = 4"),
        Some(&in_force),
    )
    .unwrap();
    assert_eq!(r.speculative.method, SpeculativeMethod::Off);
    assert_eq!(r.policy, DraftPolicy::Fixed { k: 0 });
    assert_eq!(r.changes, ["speculative.num_tokens: 12 -> 4"]);
    assert_eq!(r.file.speculative.method, SpeculativeMethod::Draft);
}

/// A bad `[router]` value in a whole file is refused with its key (the
/// router's own error, carried into this module's).
#[test]
fn router_errors_name_their_key_in_a_whole_file() {
    let e = parse("[router]\nmax_attempts = 0").unwrap_err().to_string();
    assert!(
        e.contains("router.max_attempts") && e.contains("1..=16"),
        "{e}"
    );
    let e = parse("[router]\nreplica = []").unwrap_err().to_string();
    assert!(e.contains("replica"), "{e}");
}

/// The block scalar `key: |` of a YAML file, dedented (enough YAML for the
/// ConfigMaps in deploy/k8s).
fn yaml_block(yaml: &str, key: &str) -> String {
    let mut lines = yaml.lines().skip_while(|l| l.trim() != format!("{key}: |"));
    let head = lines.next().unwrap_or_else(|| panic!("no {key} block"));
    let indent = head.len() - head.trim_start().len();
    lines
        .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
        .map(|l| l.get(indent + 2..).unwrap_or("").to_string() + "\n")
        .collect()
}

/// The configs the Kubernetes manifests ship parse and validate.
#[test]
fn manifest_configs_are_valid() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/k8s");
    let engine = std::fs::read_to_string(dir.join("engine.yaml")).unwrap();
    let c = Config::from_toml(
        &yaml_block(&engine, "engine.toml"),
        Path::new("engine.toml"),
    )
    .unwrap();
    assert_eq!((c.server.host.as_str(), c.server.port), ("0.0.0.0", 8000));
    let router = std::fs::read_to_string(dir.join("router.yaml")).unwrap();
    let c = Config::from_toml(
        &yaml_block(&router, "router.toml"),
        Path::new("router.toml"),
    )
    .unwrap();
    c.router.validate_for_routing().unwrap();
    assert_eq!(
        c.router.discovery_dns.as_deref(),
        Some("specgate-engine:8000")
    );
}
