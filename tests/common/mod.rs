//! The one support module of the root package's integration tests (and of
//! loadgen/tests, which includes it by path): where the real weights are
//! ([`models`]), tiny generated models ([`tiny`]), the HTTP/1.1 client
//! ([`client`]), reading engine streams ([`engine`]), toy grammars ([`grammar`]), the chi-square test ([`stats`]), one sequence decoded speculatively
//! ([`spec`]), and here a tiny model with an in-code ChatML tokenizer and
//! a server started in-process on 127.0.0.1:0. Everything is re-exported at
//! this level, so `use common::*` reaches it all.
// Each test binary uses a different part of this module.
#![allow(dead_code, unused_imports)]

pub mod client;
pub mod engine;
pub mod grammar;
pub mod logs;
pub mod models;
pub mod schemas;
pub mod spec;
pub mod stats;
pub mod tiny;

pub use client::*;
pub use engine::*;
pub use grammar::*;
pub use logs::*;
pub use models::*;
pub use spec::*;
pub use stats::*;
pub use tiny::*;

use candle_core::quantized::GgmlDType;
use specgate::config::Config;
use specgate::server::{start, Running};
use specgate::tokenizer::testing::tiny_chatml_metadata;
use specgate_verify::tiny::TinySpec;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The served model name of the tiny test server.
pub const MODEL: &str = "tiny";

/// The tiny target and draft files (llama, vocabulary 384, with the ChatML
/// tokenizer), written once per test process by [`tiny_gguf`], which never
/// hands out a half-written or stale file.
pub fn model_files() -> (PathBuf, PathBuf) {
    static FILES: std::sync::OnceLock<(PathBuf, PathBuf)> = std::sync::OnceLock::new();
    FILES
        .get_or_init(|| {
            let md = tiny_chatml_metadata(384);
            let md: Vec<(&str, _)> = md.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
            let spec = TinySpec {
                logit_scale: 1.5,
                ..TinySpec::llama(41)
            };
            let t = tiny_gguf(&spec, "target.gguf", &md);
            let draft = TinySpec {
                dtype: GgmlDType::Q8_0,
                ..spec
            };
            (t, tiny_gguf(&draft, "draft.gguf", &md))
        })
        .clone()
}

/// A config for the tiny server: any port, [`MODEL`] as the served name,
/// the [`model_files`] pair, n-gram speculation with a fixed length, 64 KV
/// blocks; then `edit`. Panics when the edited config does not validate.
pub fn config(edit: impl FnOnce(&mut Config)) -> Config {
    let (t, d) = model_files();
    let mut c = Config::default();
    c.server.port = 0;
    c.server.served_model_name = Some(MODEL.into());
    c.model.path = t;
    c.draft.path = Some(d);
    c.speculative.method = specgate::config::SpeculativeMethod::Ngram;
    c.speculative.policy = specgate::config::DraftPolicyKind::Fixed;
    c.kv.num_blocks = 64;
    edit(&mut c);
    c.validate().unwrap();
    c
}

/// A specgate server running in this process on its own tokio runtime;
/// dropping it shuts the server down and waits for it.
pub struct Server {
    pub rt: tokio::runtime::Runtime,
    pub running: Option<Running>,
    pub addr: SocketAddr,
}

impl Server {
    /// Starts `cfg`; `path` is the file it came from (for live reload), as
    /// loaded. Panics when the server does not start.
    pub fn start(cfg: Config, path: Option<PathBuf>) -> Server {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        // The tests' configs are the files as loaded (no flag overrides).
        let file = path.map(|path| specgate::server::ConfigFile {
            path,
            as_loaded: cfg.clone(),
        });
        let running = rt.block_on(start(cfg, file)).unwrap();
        let addr = running.addr;
        Server {
            rt,
            running: Some(running),
            addr,
        }
    }

    /// The running engine.
    pub fn engine(&self) -> &specgate::engine::EngineHandle {
        &self.running.as_ref().unwrap().engine
    }

    /// Waits until nothing runs or waits and every KV block is free; panics
    /// after 20 s (a leak, not a slow machine).
    pub fn wait_idle(&self) {
        let t = Instant::now();
        loop {
            let s = self.engine().stats();
            if s.running == 0 && s.waiting == 0 && s.free_blocks == s.num_blocks {
                return;
            }
            assert!(t.elapsed() < Duration::from_secs(20), "never idle: {s:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            let _ = r.shutdown.send(());
            let _ = self.rt.block_on(r.done);
            r.engine.shutdown();
        }
    }
}
