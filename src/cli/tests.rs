//! Every `serve` flag against its config key (table-driven, and the table
//! checked against the flags clap knows, so a new flag needs a row), the
//! API key from the environment, and clap's refusal of unknown enum names.

use super::*;
use clap::{CommandFactory, Parser};
use std::sync::Mutex;

/// Held by every test that parses `ServeArgs`: one test sets
/// `SPECGATE_API_KEY`, which every parse in the process would read.
static ENV: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    ENV.lock().unwrap_or_else(|e| e.into_inner())
}

fn serve(args: &[&str]) -> ServeArgs {
    let argv = std::iter::once("serve").chain(args.iter().copied());
    ServeArgs::try_parse_from(argv).unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

fn path(p: &Option<PathBuf>) -> String {
    p.as_ref()
        .map_or_else(String::new, |p| p.display().to_string())
}

/// A flag, a value for it, the key it overrides, and that key read back as
/// text. Every value differs from the default and passes validation.
type Row = (
    &'static str,
    &'static str,
    &'static str,
    fn(&Config) -> String,
);

const ROWS: &[Row] = &[
    ("--host", "0.0.0.0", "server.host", |c| {
        c.server.host.clone()
    }),
    ("--port", "9001", "server.port", |c| {
        c.server.port.to_string()
    }),
    ("--api-key", "sk-flag", "server.api_keys", |c| {
        c.server.api_keys.join(",")
    }),
    (
        "--cors-allow-origin",
        "https://app.example.com",
        "server.cors_allow_origins",
        |c| c.server.cors_allow_origins.join(","),
    ),
    (
        "--served-model-name",
        "coder",
        "server.served_model_name",
        |c| c.server.served_model_name.clone().unwrap_or_default(),
    ),
    (
        "--max-concurrent-requests",
        "8",
        "server.max_concurrent_requests",
        |c| c.server.max_concurrent_requests.to_string(),
    ),
    (
        "--request-timeout-secs",
        "60",
        "server.request_timeout_secs",
        |c| c.server.request_timeout_secs.to_string(),
    ),
    ("--model", "m/target.gguf", "model.path", |c| {
        c.model.path.display().to_string()
    }),
    (
        "--tensor-parallel-size",
        "2",
        "model.tensor_parallel_size",
        |c| c.model.tensor_parallel_size.to_string(),
    ),
    ("--max-model-len", "4096", "model.max_model_len", |c| {
        c.model
            .max_model_len
            .map_or_else(String::new, |n| n.to_string())
    }),
    (
        "--chat-template",
        "t/chat.jinja",
        "model.chat_template",
        |c| path(&c.model.chat_template),
    ),
    ("--draft", "m/draft.gguf", "draft.path", |c| {
        path(&c.draft.path)
    }),
    (
        "--draft-head-tokens",
        "heads.txt",
        "draft.head_tokens",
        |c| path(&c.draft.head_tokens),
    ),
    ("--block-size", "32", "kv.block_size", |c| {
        c.kv.block_size.to_string()
    }),
    ("--num-blocks", "128", "kv.num_blocks", |c| {
        c.kv.num_blocks.to_string()
    }),
    ("--kv-memory-mib", "2048", "kv.memory_mib", |c| {
        c.kv.memory_mib.to_string()
    }),
    ("--distributed", "mpi", "model.distributed", |c| {
        c.model.distributed.to_string()
    }),
    ("--rank-timeout-secs", "5", "model.rank_timeout_secs", |c| {
        c.model.rank_timeout_secs.to_string()
    }),
    (
        "--load-timeout-secs",
        "90",
        "model.load_timeout_secs",
        |c| c.model.load_timeout_secs.to_string(),
    ),
    ("--kv-latent-dtype", "bf16", "kv.latent_dtype", |c| {
        c.kv.latent_dtype.to_string()
    }),
    ("--prefix-caching", "false", "kv.prefix_caching", |c| {
        c.kv.prefix_caching.to_string()
    }),
    (
        "--state-checkpoint-mib",
        "64",
        "kv.state_checkpoint_mib",
        |c| c.kv.state_checkpoint_mib.to_string(),
    ),
    ("--row-state-mib", "32", "kv.row_state_mib", |c| {
        c.kv.row_state_mib.to_string()
    }),
    ("--max-num-seqs", "64", "scheduler.max_num_seqs", |c| {
        c.scheduler.max_num_seqs.to_string()
    }),
    (
        "--max-num-batched-tokens",
        "1024",
        "scheduler.max_num_batched_tokens",
        |c| c.scheduler.max_num_batched_tokens.to_string(),
    ),
    ("--speculative-method", "ngram", "speculative.method", |c| {
        c.speculative.method.to_string()
    }),
    (
        "--speculative-policy",
        "adaptive",
        "speculative.policy",
        |c| c.speculative.policy.to_string(),
    ),
    (
        "--num-speculative-tokens",
        "5",
        "speculative.num_tokens",
        |c| c.speculative.num_tokens.to_string(),
    ),
    ("--ngram-min", "2", "speculative.ngram_min", |c| {
        c.speculative.ngram_min.to_string()
    }),
    ("--ngram-max", "6", "speculative.ngram_max", |c| {
        c.speculative.ngram_max.to_string()
    }),
];

/// Each flag alone changes its key (and only its key) to the flag's value,
/// over the defaults; and every flag together still validates.
#[test]
fn every_serve_flag_overrides_its_config_key() {
    let _env = lock();
    let base = Config::default();
    let mut all = Vec::new();
    for &(flag, value, key, read) in ROWS {
        assert_ne!(
            read(&base),
            value,
            "{flag}: pick a value that is not the default"
        );
        let mut cfg = base.clone();
        serve(&[flag, value]).apply(&mut cfg);
        assert_eq!(read(&cfg), value, "{flag} -> {key}");
        cfg.validate()
            .unwrap_or_else(|e| panic!("{flag} {value}: {e}"));
        // Nothing else moved.
        for &(other, _, other_key, read_other) in ROWS {
            if other != flag {
                assert_eq!(
                    read_other(&cfg),
                    read_other(&base),
                    "{flag} moved {other_key}"
                );
            }
        }
        all.extend([flag, value]);
    }
    let mut unchanged = base.clone();
    serve(&[]).apply(&mut unchanged);
    assert_eq!(unchanged, base, "no flags change nothing");
    let mut cfg = base.clone();
    serve(&all).apply(&mut cfg);
    cfg.validate().unwrap();
    for &(flag, value, key, read) in ROWS {
        assert_eq!(read(&cfg), value, "{flag} -> {key} (all flags at once)");
    }
}

/// The table covers every flag clap knows, and every flag has help text
/// (what `specgate serve --help` shows).
#[test]
fn the_table_covers_every_documented_flag() {
    let cmd = ServeArgs::command();
    let mut flags = Vec::new();
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if ["help", "config"].contains(&long) {
            continue;
        }
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        assert!(!help.is_empty(), "--{long} has no help");
        flags.push(format!("--{long}"));
    }
    let rows: Vec<String> = ROWS.iter().map(|r| r.0.to_owned()).collect();
    flags.sort();
    let mut sorted = rows.clone();
    sorted.sort();
    assert_eq!(flags, sorted);
    // Each row names the key its flag's help says it overrides.
    for &(flag, _, key, _) in ROWS {
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_long() == flag.strip_prefix("--"))
            .unwrap();
        let help = arg.get_help().unwrap().to_string();
        let (section, name) = key.split_once('.').unwrap();
        assert!(
            help.contains(&format!("[{section}] {name}")),
            "{flag}: help does not name {key}: {help}"
        );
    }
}

#[test]
fn api_keys_repeat_and_come_from_the_environment() {
    let _env = lock();
    let keys = |a: &ServeArgs| {
        let mut c = Config::default();
        a.apply(&mut c);
        c.server.api_keys
    };
    assert_eq!(
        keys(&serve(&["--api-key", "a", "--api-key", "b"])),
        ["a", "b"]
    );
    assert!(keys(&serve(&[])).is_empty());
    std::env::set_var("SPECGATE_API_KEY", "sk-from-env");
    let from_env = keys(&serve(&[]));
    let flag_wins = keys(&serve(&["--api-key", "sk-flag"]));
    let help = ServeArgs::command().render_long_help().to_string();
    std::env::remove_var("SPECGATE_API_KEY");
    assert_eq!(from_env, ["sk-from-env"]);
    assert_eq!(flag_wins, ["sk-flag"]);
    // --help names the variable but never prints a secret.
    assert!(help.contains("SPECGATE_API_KEY"), "{help}");
    assert!(!help.contains("sk-from-env"), "{help}");
}

#[test]
fn a_bad_method_is_a_clap_error_listing_the_allowed_values() {
    let _env = lock();
    let e = ServeArgs::try_parse_from(["serve", "--speculative-method", "eagle"]).unwrap_err();
    assert_eq!(e.kind(), clap::error::ErrorKind::InvalidValue);
    let text = e.to_string();
    assert!(
        text.contains("possible values: draft, ngram, off"),
        "{text}"
    );
    let e = ServeArgs::try_parse_from(["serve", "--speculative-policy", "Table"]).unwrap_err();
    assert!(
        e.to_string()
            .contains("possible values: fixed, table, adaptive"),
        "{e}"
    );
    // --help lists them with what each does.
    let help = ServeArgs::command().render_long_help().to_string();
    for name in ["draft", "ngram", "off", "fixed", "table", "adaptive"] {
        assert!(help.contains(&format!("{name}:")), "{name}: {help}");
    }
}

/// `resolve`: the file under the flags, checked; the file as loaded kept
/// apart for reloads.
#[test]
fn resolve_layers_flags_over_the_file_and_checks_the_result() {
    let _env = lock();
    let dir = std::env::temp_dir().join(format!("specgate-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("serve.toml");
    std::fs::write(
        &file,
        "[server]\nport = 7000\n[speculative]\nmethod = \"ngram\"\nnum_tokens = 5\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let (cfg, loaded) = serve(&["--config", f, "--port", "0", "--speculative-method", "off"])
        .resolve()
        .unwrap();
    let loaded = loaded.unwrap();
    assert_eq!((cfg.server.port, loaded.as_loaded.server.port), (0, 7000));
    assert_eq!(cfg.speculative.method, SpeculativeMethod::Off);
    assert_eq!(
        loaded.as_loaded.speculative.method,
        SpeculativeMethod::Ngram
    );
    assert_eq!(cfg.speculative.num_tokens, 5, "the file's value stays");
    assert_eq!(loaded.path, file);
    // A flag's value is checked like the file's.
    let refused = |args: &[&str]| match serve(args).resolve() {
        Ok(_) => panic!("accepted: {args:?}"),
        Err(e) => e.to_string(),
    };
    let e = refused(&["--config", f, "--max-num-seqs", "0"]);
    assert!(e.contains("scheduler.max_num_seqs"), "{e}");
    let e = refused(&["--max-model-len", "0"]);
    assert!(e.contains("model.max_model_len"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn route_flags_override_the_router_section() {
    let argv = [
        "route",
        "--host",
        "0.0.0.0",
        "--port",
        "9100",
        "--replica",
        "http://10.0.0.1:8000",
        "--replica",
        "http://10.0.0.2:8000",
        "--discovery-dns",
        "engines:8000",
    ];
    let cfg = RouteArgs::try_parse_from(argv).unwrap().resolve().unwrap();
    assert_eq!((cfg.host.as_str(), cfg.port), ("0.0.0.0", 9100));
    assert_eq!(
        cfg.replicas,
        ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    );
    assert_eq!(cfg.discovery_dns.as_deref(), Some("engines:8000"));
    let e = RouteArgs::try_parse_from(["route"])
        .unwrap()
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(e.contains("router.replicas"), "{e}");
}

/// `--model` alone (no file, no draft, no method) asks for no draft, so
/// the method is auto; a draft or a method asked for, or a file, keeps
/// what was asked (the built-in `draft`, which must then fit).
#[test]
fn without_config_draft_or_method_the_method_is_auto() {
    let _env = lock();
    let method = |args: &[&str]| serve(args).resolve().unwrap().0.speculative.method;
    assert_eq!(method(&["--model", "m.gguf"]), SpeculativeMethod::Auto);
    assert_eq!(method(&[]), SpeculativeMethod::Auto);
    assert_eq!(
        method(&["--model", "m.gguf", "--draft", "d.gguf"]),
        SpeculativeMethod::Draft
    );
    for m in ["draft", "ngram", "off", "auto"] {
        let got = method(&["--model", "m.gguf", "--speculative-method", m]);
        assert_eq!(got.to_string(), m);
    }
    let dir = std::env::temp_dir().join(format!("specgate-cli-auto-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("serve.toml");
    std::fs::write(&file, "[server]\nport = 7000\n").unwrap();
    let got = method(&["--config", file.to_str().unwrap(), "--model", "m.gguf"]);
    assert_eq!(
        got,
        SpeculativeMethod::Draft,
        "the file's method (its default)"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
