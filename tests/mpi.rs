//! Ranks as processes under `mpirun` (`--features mpi`): the tiny Kimi K3
//! (hybrid KDA + MLA, latent MoE) and the tiny Kimi K2 (DeepSeek-V3 layout)
//! give the logits of one unsharded model at 2 and 4 ranks, over shared
//! memory and over TCP (`--mca btl self,tcp`, as across hosts);
//! `serve --distributed mpi` gives the same greedy text as one process
//! (draft model and n-gram speculation, 12 concurrent requests with
//! preemption); conversations resume from recurrent-state checkpoints with
//! the text of one process without prefix caching; a worker that is
//! killed or hangs turns /health to 503,
//! ends the in-flight request with an error and ends the job non-zero; and
//! a group that cannot start (a worker that cannot load its shard, rank 0
//! that cannot bind its port, a worker that never finishes loading) ends
//! `mpirun` non-zero within the load deadline, the cause on stderr.
//!
//! Skipped, with the reason printed, in a build without the `mpi` feature
//! or where `mpirun` is not installed (scripts/test.sh installs Open MPI
//! and runs this file with the feature).

mod common;

use common::*;
use serde_json::{json, Value};
use specgate_verify::model::{load_safetensors, LogitsWanted, Model, SeqInput};
use specgate_verify::KvPool;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// Set in the environment of a test binary started by `mpirun` as one rank
/// of [`logits_equal_world_1_at_2_and_4_ranks`]: the fixture directory.
const CHILD_DIR: &str = "SPECGATE_MPI_CHILD_DIR";
/// Where that child's rank 0 writes its logits (JSON).
const CHILD_OUT: &str = "SPECGATE_MPI_CHILD_OUT";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `mpirun`, when this build has the `mpi` feature and it is installed;
/// otherwise prints why the test is skipped.
fn mpirun() -> Option<&'static str> {
    if !cfg!(feature = "mpi") {
        eprintln!("skipped: built without the `mpi` feature (cargo test --features mpi)");
        return None;
    }
    match Command::new("mpirun").arg("--version").output() {
        Ok(o) if o.status.success() => Some("mpirun"),
        _ => {
            eprintln!("skipped: `mpirun` not found (apt-get install openmpi-bin libopenmpi-dev)");
            None
        }
    }
}

/// `mpirun -np N` with the flags a container needs (root, more ranks than
/// cores), over `btl` when given.
fn mpi_command(np: usize, btl: Option<&str>) -> Command {
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &np.to_string(),
    ]);
    if let Some(b) = btl {
        c.args(["--mca", "btl", b]);
    }
    // One thread team per rank, small: the ranks share the machine.
    c.args(["-x", "RAYON_NUM_THREADS=1"]);
    c
}

/// A serving-like run of forwards and pool operations (prefill, a
/// verification whose drafts are partly rejected next to a prefill,
/// released state slots); every forward's logits.
fn script(model: &Model) -> Vec<Vec<Vec<f32>>> {
    let mut pool = KvPool::for_model(model, 16, 4).unwrap();
    let recurrent = model.has_recurrent_state();
    let seq = |tokens, start_pos, block_table, logits, state_slot| SeqInput {
        tokens,
        start_pos,
        block_table,
        logits,
        state_slot,
    };
    let (a, b): (&[u32], &[u32]) = (&[0, 1, 2, 3], &[4, 5, 6, 7]);
    let mut out = Vec::new();
    let steps: Vec<Vec<SeqInput>> = vec![
        vec![seq(&[1, 5, 9, 20, 33, 7], 0, a, LogitsWanted::Last, 0)],
        vec![
            seq(&[11, 12, 13, 14], 6, a, LogitsWanted::All, 0),
            seq(&[3, 3, 8], 0, b, LogitsWanted::Last, 1),
        ],
        vec![
            seq(&[40, 41, 42], 8, a, LogitsWanted::All, 0),
            seq(&[9, 10], 3, b, LogitsWanted::All, 1),
        ],
        vec![
            seq(&[50], 11, a, LogitsWanted::Last, 0),
            seq(&[2, 4, 6, 8, 12], 0, b, LogitsWanted::All, 1),
        ],
    ];
    for (i, step) in steps.iter().enumerate() {
        out.push(model.forward_rows(&mut pool, step).unwrap());
        if recurrent {
            match i {
                1 => pool.keep_rows(0, 2).unwrap(),
                2 => {
                    pool.keep_rows(0, 3).unwrap();
                    pool.keep_rows(1, 1).unwrap();
                    pool.release_state(1);
                }
                _ => {}
            }
        }
    }
    out
}

/// One rank of an `mpirun` started by the test below (does nothing in a
/// plain test run): loads its shard, rank 0 leads [`script`] and writes
/// its logits, the others follow.
#[test]
fn mpi_child_rank() {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    #[cfg(feature = "mpi")]
    {
        use specgate_verify::model::{load_model_shard, serve_worker};
        use specgate_verify::tp::MpiComm;
        use specgate_verify::Communicator;
        let (comm, session) =
            MpiComm::init(Duration::from_secs(60), Duration::from_secs(1)).unwrap();
        let rank = comm.rank();
        check_all_reduce(&comm);
        let mut m = load_model_shard(Path::new(&dir), Box::new(comm)).unwrap();
        if rank == 0 {
            m.lead().unwrap();
            let logits = script(&m);
            drop(m);
            let out = std::env::var(CHILD_OUT).unwrap();
            std::fs::write(out, serde_json::to_string(&logits).unwrap()).unwrap();
        } else {
            serve_worker(&mut m).unwrap();
            drop(m);
        }
        drop(session);
    }
    #[cfg(not(feature = "mpi"))]
    panic!("{CHILD_DIR} set in a build without MPI ({dir})");
}

/// Set for the rank of [`rank_0_gives_up_on_a_worker_that_never_loads`]
/// that joins MPI and then never loads anything (as a worker stuck reading
/// a slow volume would): how long it idles.
const IDLE_RANK_SECS: &str = "SPECGATE_MPI_IDLE_RANK_SECS";

/// That idle rank (does nothing in a plain test run).
#[test]
fn mpi_idle_rank() {
    let Ok(secs) = std::env::var(IDLE_RANK_SECS) else {
        return;
    };
    #[cfg(feature = "mpi")]
    {
        let _mpi =
            specgate_verify::tp::MpiComm::init(Duration::from_secs(60), Duration::ZERO).unwrap();
        thread::sleep(Duration::from_secs(secs.parse().unwrap()));
        // Still here: rank 0 never gave up. Exit without finalising (that
        // would wait for rank 0): mpirun reports the job failed.
        std::process::exit(7);
    }
    #[cfg(not(feature = "mpi"))]
    panic!("{IDLE_RANK_SECS} set in a build without MPI ({secs})");
}

/// Every rank's contribution to the all-reduce checks: values whose sum
/// depends on the order of addition.
#[cfg(feature = "mpi")]
fn contribution(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((rank * 7919 + i * 104_729) % 1000) as f32 * 1.37e-3 + (rank as f32) * 1e-7)
        .collect()
}

/// The all-reduce of a process group equals the rank-ordered sum (the
/// threaded group's) bit for bit, on both of its algorithms: the gather
/// for small buffers, the scatter-sum-gather for large ones at 3 or more
/// ranks (140,001 floats: past 1 MiB gathered at 4 ranks, and not a
/// multiple of the world size). The stats
/// count every call.
#[cfg(feature = "mpi")]
fn check_all_reduce(comm: &dyn specgate_verify::Communicator) {
    let (rank, world) = (comm.rank(), comm.world_size());
    let before = comm.stats();
    let sizes = [1usize, 5, 1000, 140_001];
    for n in sizes {
        let mut buf = contribution(rank, n);
        comm.all_reduce_sum(&mut buf).unwrap();
        let mut expected = contribution(0, n);
        for r in 1..world {
            for (e, c) in expected.iter_mut().zip(contribution(r, n)) {
                *e += c;
            }
        }
        let same = buf
            .iter()
            .zip(&expected)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "rank {rank} of {world}: all-reduce of {n} floats");
    }
    let spent = comm.stats().since(&before);
    assert_eq!(spent.calls, sizes.len() as u64, "rank {rank}");
    let floats: usize = sizes.iter().sum();
    assert!(
        spent.bytes_out >= 4 * floats as u64,
        "rank {rank}: {spent:?}"
    );
}

fn max_rel_diff(a: &[Vec<Vec<f32>>], b: &[Vec<Vec<f32>>]) -> f32 {
    let flat =
        |x: &[Vec<Vec<f32>>]| -> Vec<f32> { x.iter().flatten().flatten().copied().collect() };
    let (a, b) = (flat(a), flat(b));
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    d / scale.max(1e-6)
}

/// The tensor-parallel tolerance of the in-process tests (max |diff| over
/// max |logit|), as at world size 2 and 4 in threads.
const TP_TOL: f32 = 1e-4;

#[test]
fn logits_equal_world_1_at_2_and_4_ranks_over_shm_and_tcp() {
    if mpirun().is_none() {
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let fixtures = [
        root().join("tests/fixtures/kimi_k3/tiny-hf"),
        root().join("tests/fixtures/tiny-kimi"),
    ];
    let out = scratch_dir("mpi-logits").join("logits.json");
    for dir in &fixtures {
        let single = script(&load_safetensors(dir).unwrap());
        for (np, btl) in [
            (2, None),
            (4, None),
            (2, Some("self,tcp")),
            (4, Some("self,tcp")),
        ] {
            let _ = std::fs::remove_file(&out);
            let status = mpi_command(np, btl)
                .arg(&exe)
                .args([
                    "--exact",
                    "mpi_child_rank",
                    "--test-threads",
                    "1",
                    "--nocapture",
                ])
                .env(CHILD_DIR, dir)
                .env(CHILD_OUT, &out)
                .stdout(Stdio::null())
                .status()
                .unwrap();
            assert!(
                status.success(),
                "{}: np {np} btl {btl:?}: {status}",
                dir.display()
            );
            let led: Vec<Vec<Vec<f32>>> =
                serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
            let d = max_rel_diff(&single, &led);
            eprintln!("{}: np {np} btl {btl:?}: max rel diff {d:e}", dir.display());
            assert!(d < TP_TOL, "{}: np {np} btl {btl:?}: {d}", dir.display());
        }
    }
}

/// A `specgate serve` (under mpirun or alone), its log read to the end.
struct Serve {
    child: Child,
    addr: SocketAddr,
    /// Log lines read while starting.
    early: Vec<String>,
    /// Later log lines, as they come.
    log: mpsc::Receiver<String>,
}

impl Serve {
    /// Starts `cmd` (a `specgate serve` command line) and waits until
    /// /health answers 200.
    fn start(mut cmd: Command) -> Serve {
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning specgate serve");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if std::env::var_os("SPECGATE_TEST_SHOW_LOG").is_some() {
                    eprintln!("{line}");
                }
                let _ = tx.send(line);
            }
        });
        let started = Instant::now();
        let mut early = Vec::new();
        let addr = loop {
            let line = rx
                .recv_timeout(Duration::from_secs(120))
                .expect("specgate serve never reported its address");
            let addr = line
                .split_once("specgate bound to http://")
                .map(|(_, rest)| rest.split_whitespace().next().unwrap().parse().unwrap());
            early.push(line);
            if let Some(a) = addr {
                break a;
            }
        };
        while request(addr, "GET", "/health", &[], "").status != 200 {
            assert!(started.elapsed() < Duration::from_secs(120), "never ready");
            thread::sleep(Duration::from_millis(50));
        }
        Serve {
            child,
            addr,
            early,
            log: rx,
        }
    }

    /// The pid a rank logged ("rank R of N (pid P) joined ...").
    fn rank_pid(&mut self, rank: usize) -> u32 {
        self.early.extend(self.log.try_iter());
        self.early
            .iter()
            .find_map(|l| {
                let rest = l.split_once(&format!("rank {rank} of "))?.1;
                rest.split_once("(pid ")?.1.split(')').next()?.parse().ok()
            })
            .expect("the rank logged its pid")
    }

    /// Waits up to `limit` for the process to exit.
    fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let t = Instant::now();
        while t.elapsed() < limit {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        // SIGTERM: rank 0 drains and stops the workers; then make sure.
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        if self.wait_exit(Duration::from_secs(20)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `specgate serve` on the tiny K3 config with `extra` flags, under
/// `mpirun -np np` (0: one process, no MPI).
fn k3_serve(np: usize, btl: Option<&str>, extra: &[&str]) -> Command {
    let exe = env!("CARGO_BIN_EXE_specgate");
    let mut c = if np == 0 {
        Command::new(exe)
    } else {
        let mut c = mpi_command(np, btl);
        c.arg(exe);
        c
    };
    c.current_dir(root())
        .args([
            "serve",
            "--config",
            "configs/kimi-k3-tiny.toml",
            "--port",
            "0",
        ])
        .args(extra);
    if np > 0 {
        c.args(["--distributed", "mpi"]);
    }
    c
}

fn k3_chat(content: &str, max_tokens: usize, extra: Value) -> Value {
    let mut b = json!({"model": "kimi-k3-tiny", "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true});
    b.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    b
}

/// A chat turn's whole text (reasoning then content). Read with a long
/// timeout: 12 of these at once over 4 ranks on 2 cores of a loaded host
/// outlast the usual 30 s.
fn text(addr: SocketAddr, body: Value) -> String {
    let s = send(
        addr,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json")],
        &body.to_string(),
    );
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    turn_text(&read_response(s))
}

/// Greedy answers of one server: draft-model, n-gram and no speculation,
/// and 12 prompts sent at once (with a pool small enough to preempt).
fn answers(addr: SocketAddr) -> (Vec<String>, Vec<String>, f64) {
    let mut single = Vec::new();
    for spec in [
        json!({}),
        json!({"speculative": {"method": "ngram", "num_tokens": 4}}),
        json!({"speculative": {"method": "off"}}),
    ] {
        single.push(text(addr, k3_chat("write a haiku", 24, spec)));
    }
    let prompts: Vec<String> = (0..12).map(|i| format!("story number {i}")).collect();
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let body = k3_chat(p, 80, json!({}));
            thread::spawn(move || text(addr, body))
        })
        .collect();
    let together: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let preempted = metric(
        &request(addr, "GET", "/metrics", &[], "").body,
        "specgate_num_preemptions_total",
    );
    for (p, t) in prompts.iter().zip(&together) {
        assert_eq!(
            &text(addr, k3_chat(p, 80, json!({}))),
            t,
            "{p}: together vs alone"
        );
    }
    (single, together, preempted)
}

/// A pool small enough that the 12 requests (about 260 prompt tokens, 17
/// blocks of 16, each growing to 22) preempt one another.
const SMALL_POOL: &[&str] = &["--num-blocks", "40", "--max-num-seqs", "12"];

#[test]
fn serving_over_mpi_gives_the_text_of_one_process() {
    if mpirun().is_none() {
        return;
    }
    for (np, btl) in [(2, None), (4, Some("self,tcp"))] {
        // The same sharding in one process (ranks as threads): the text of
        // a random-weight model can flip on float summation order, so the
        // reference splits the same way.
        let tp = np.to_string();
        let mut flags = SMALL_POOL.to_vec();
        flags.extend(["--tensor-parallel-size", &tp]);
        let alone = Serve::start(k3_serve(0, None, &flags));
        let (single, together, _) = answers(alone.addr);
        drop(alone);
        assert_eq!(single[0], single[1], "tp {np}: draft vs n-gram");
        assert_eq!(single[0], single[2], "tp {np}: draft vs off");
        let s = Serve::start(k3_serve(np, btl, SMALL_POOL));
        let (s1, t1, preempted) = answers(s.addr);
        assert_eq!(s1, single, "np {np} btl {btl:?}");
        assert_eq!(t1, together, "np {np} btl {btl:?}");
        assert!(preempted > 0.0, "np {np}: the pool was meant to preempt");
        let mut s = s;
        // SIGTERM to rank 0 (not to mpirun, which would kill the job):
        // it drains, stops the workers, and every process exits 0.
        let rank0 = s.rank_pid(0);
        let _ = Command::new("kill").arg(rank0.to_string()).status();
        let status = s
            .wait_exit(Duration::from_secs(30))
            .expect("exits after SIGTERM");
        assert!(status.success(), "np {np}: a clean stop exits 0: {status}");
    }
}

/// A conversation of four greedy turns, each answer fed back as the
/// assistant's message: the answers.
fn conversation(addr: SocketAddr) -> Vec<String> {
    let mut messages = vec![json!({"role": "system", "content":
        "You are a careful assistant. Answer in one short line and keep to the facts \
         the user gives you; say so when you do not know."})];
    let mut answers = Vec::new();
    for t in 0..4 {
        messages.push(json!({"role": "user", "content": format!("question {t}: name a colour")}));
        let mut body = k3_chat("", 16, json!({}));
        body["messages"] = json!(messages);
        let answer = text(addr, body);
        messages.push(json!({"role": "assistant", "content": answer}));
        answers.push(answer);
    }
    answers
}

/// Kimi K3 conversations over ranks run as processes: a later turn
/// restores a recurrent-state checkpoint (rank 0 decides, every rank copies
/// its shard in the same step message), and the text is that of one
/// process with prefix caching off.
#[test]
fn conversations_over_mpi_resume_from_checkpoints_with_the_same_text() {
    if mpirun().is_none() {
        return;
    }
    let alone = Serve::start(k3_serve(
        0,
        None,
        &["--tensor-parallel-size", "2", "--prefix-caching", "false"],
    ));
    let reference = conversation(alone.addr);
    drop(alone);
    let mut s = Serve::start(k3_serve(2, None, &[]));
    assert_eq!(conversation(s.addr), reference);
    let metrics = request(s.addr, "GET", "/metrics", &[], "").body;
    let hits = metric(&metrics, "specgate_state_checkpoint_hits_total");
    assert!(hits >= 3.0, "{hits} checkpoint hits");
    let rank0 = s.rank_pid(0);
    let _ = Command::new("kill").arg(rank0.to_string()).status();
    let status = s
        .wait_exit(Duration::from_secs(30))
        .expect("exits after SIGTERM");
    assert!(status.success(), "a clean stop exits 0: {status}");
}

/// Sends a long streaming request; returns a thread that reads it to its
/// end and returns (whether it ended with an error event or a cut
/// connection, when it ended, what it read).
fn in_flight(addr: SocketAddr) -> thread::JoinHandle<(bool, Instant, String)> {
    let body = k3_chat("a long story", 3000, json!({"stream": true})).to_string();
    let conn = send(
        addr,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json")],
        &body,
    );
    thread::spawn(move || {
        let mut conn = conn;
        conn.set_read_timeout(Some(Duration::from_secs(120)))
            .unwrap();
        let mut raw = Vec::new();
        let _ = std::io::Read::read_to_end(&mut conn, &mut raw);
        let text = String::from_utf8_lossy(&raw).into_owned();
        let failed = text.contains("\"error\"") || !text.contains("[DONE]");
        (failed, Instant::now(), text)
    })
}

/// Polls /health until it is not 200 (a 503, or no answer once the job
/// is gone); the time that took.
fn until_unhealthy(addr: SocketAddr, since: Instant, limit: Duration) -> (Duration, String) {
    loop {
        let probe = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1));
        let seen = match probe {
            Err(_) => Some("connection refused".to_string()),
            Ok(_) => {
                let r = std::panic::catch_unwind(|| request(addr, "GET", "/health", &[], ""));
                match r {
                    Ok(r) if r.status == 200 => None,
                    Ok(r) => Some(format!("{}", r.status)),
                    Err(_) => Some("connection reset".to_string()),
                }
            }
        };
        if let Some(s) = seen {
            return (since.elapsed(), s);
        }
        assert!(since.elapsed() < limit, "/health still 200 after {limit:?}");
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_killed_or_hung_worker_fails_the_job_loudly() {
    if mpirun().is_none() {
        return;
    }
    for (signal, timeout) in [("-KILL", "60"), ("-STOP", "3")] {
        let mut s = Serve::start(k3_serve(2, None, &["--rank-timeout-secs", timeout]));
        let pid = s.rank_pid(1);
        let req = in_flight(s.addr);
        thread::sleep(Duration::from_millis(500));
        let t0 = Instant::now();
        assert!(Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .unwrap()
            .success());
        let (detected, how) = until_unhealthy(s.addr, t0, Duration::from_secs(30));
        let (failed, ended, body) = req.join().unwrap();
        let status = s.wait_exit(Duration::from_secs(30)).expect("the job ends");
        eprintln!(
            "worker {signal}: /health {how} after {:.2} s; request ended (failed: {failed}) \
             after {:.2} s; job exit {status} after {:.2} s",
            detected.as_secs_f64(),
            ended.duration_since(t0).as_secs_f64(),
            t0.elapsed().as_secs_f64()
        );
        if signal == "-STOP" {
            // Rank 0 itself saw the hang: it served 503, not a dead port.
            assert_eq!(how, "503", "a hung worker: rank 0 answers 503");
            assert!(
                body.contains("rank group failed"),
                "a hung worker: the request's error says why: {body}"
            );
            let _ = Command::new("kill")
                .args(["-CONT", &pid.to_string()])
                .status();
        }
        assert!(
            failed,
            "worker {signal}: the in-flight request must fail, not finish"
        );
        assert!(
            !status.success(),
            "worker {signal}: the job must exit non-zero"
        );
    }
}

/// A worker whose forward fails (on purpose, at its 30th step: no real
/// batch fails on a worker alone, since rank 0 checks each one first)
/// tells rank 0 why: rank 0 answers 503, the in-flight request ends with
/// an error that carries the worker's reason, and the job exits non-zero.
#[test]
fn a_worker_that_fails_its_forward_fails_the_requests_with_its_reason() {
    if mpirun().is_none() {
        return;
    }
    let mut cmd = k3_serve(2, None, &[]);
    // mpirun's ranks on this host inherit its environment.
    cmd.env(specgate_verify::model::FAULT_STEP_ENV, "30");
    let mut s = Serve::start(cmd);
    let t0 = Instant::now();
    let req = in_flight(s.addr);
    let (detected, how) = until_unhealthy(s.addr, t0, Duration::from_secs(60));
    let (failed, ended, body) = req.join().unwrap();
    let status = s.wait_exit(Duration::from_secs(30)).expect("the job ends");
    eprintln!(
        "worker fails step 30: /health {how} after {:.2} s; request ended after {:.2} s; \
         job exit {status} after {:.2} s",
        detected.as_secs_f64(),
        ended.duration_since(t0).as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(how, "503", "rank 0 heard the worker and answers 503");
    assert!(failed, "the in-flight request must fail, not finish");
    assert!(
        body.contains("rank group failed") && body.contains("failed on purpose"),
        "the request's error carries the worker's reason: {body}"
    );
    assert!(!status.success(), "the job must exit non-zero");
}

/// Runs an `mpirun` command line that must fail, with its stderr captured:
/// (its exit status, how long it ran, its stderr), or `None` when it still
/// runs after `limit` (then it is stopped: SIGTERM to mpirun, which ends
/// its ranks, then SIGKILL).
fn run_failing_group(mut cmd: Command, limit: Duration) -> (Option<ExitStatus>, Duration, String) {
    let t0 = Instant::now();
    let mut child = cmd
        .current_dir(root())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning mpirun");
    let stderr = child.stderr.take().unwrap();
    let reader = thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let mut status = None;
    while t0.elapsed() < limit {
        if let Some(s) = child.try_wait().unwrap() {
            status = Some(s);
            break;
        }
        thread::sleep(Duration::from_millis(100));
    }
    let ran = t0.elapsed();
    if status.is_none() {
        let _ = Command::new("kill").arg(child.id().to_string()).status();
        let t = Instant::now();
        while child.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(20) {
            thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
    }
    // Reaped either way (a status seen by try_wait is returned again).
    let _ = child.wait();
    (status, ran, reader.join().unwrap())
}

/// `specgate serve` on the tiny K3 config as one app context of an
/// `mpirun` command line (`extra` flags after the config's; `--port 0`
/// unless they name one).
fn serve_args(cmd: &mut Command, extra: &[&str]) {
    cmd.arg(env!("CARGO_BIN_EXE_specgate"))
        .args(["serve", "--config", "configs/kimi-k3-tiny.toml"])
        .args(["--host", "127.0.0.1", "--distributed", "mpi"])
        .args(extra);
    if !extra.contains(&"--port") {
        cmd.args(["--port", "0"]);
    }
}

/// The load deadline these tests give rank 0: far above a tiny shard's load
/// on a busy host, far below the hour of the default.
const LOAD_SECS: u64 = 60;

/// A worker whose shard is not there (its own `--model`, through mpirun's
/// per-rank app contexts) aborts the job at once: mpirun exits non-zero
/// within the load deadline, and stderr names the rank and the cause.
/// (Before: the worker returned, its MPI finalisation waited for rank 0,
/// and rank 0 waited for the pool announcement for ever.)
#[test]
fn a_worker_that_cannot_load_its_shard_ends_the_job_with_its_cause() {
    if mpirun().is_none() {
        return;
    }
    let load = LOAD_SECS.to_string();
    let missing = scratch_dir("mpi-missing-shard").join("no-such-checkpoint");
    let missing = missing.to_str().unwrap();
    let mut cmd = mpi_command(1, Some("self,tcp"));
    serve_args(&mut cmd, &["--load-timeout-secs", &load]);
    cmd.args([":", "-np", "1"]);
    serve_args(
        &mut cmd,
        &["--load-timeout-secs", &load, "--model", missing],
    );
    let limit = Duration::from_secs(LOAD_SECS + 30);
    let (status, ran, stderr) = run_failing_group(cmd, limit);
    eprintln!("worker without a shard: {status:?} after {ran:?}");
    let status = status
        .unwrap_or_else(|| panic!("mpirun still ran after {limit:?} (the group hangs):\n{stderr}"));
    assert!(!status.success(), "the job must fail: {status}\n{stderr}");
    assert!(
        stderr.contains("MPI rank 1 of 2") && stderr.contains("cannot load its shard"),
        "stderr names the rank and what failed:\n{stderr}"
    );
    assert!(stderr.contains(missing), "stderr names the path:\n{stderr}");
}

/// Rank 0 whose port is taken aborts the job: mpirun exits non-zero and
/// stderr says why. (Before: rank 0 returned its error, and its MPI
/// finalisation waited for the workers, which waited for its first
/// broadcast.)
#[test]
fn rank_0_that_cannot_bind_its_port_ends_the_job() {
    if mpirun().is_none() {
        return;
    }
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let mut cmd = mpi_command(2, Some("self,tcp"));
    serve_args(
        &mut cmd,
        &[
            "--load-timeout-secs",
            &LOAD_SECS.to_string(),
            "--port",
            &port,
        ],
    );
    let limit = Duration::from_secs(LOAD_SECS + 30);
    let (status, ran, stderr) = run_failing_group(cmd, limit);
    drop(taken);
    eprintln!("rank 0 without its port: {status:?} after {ran:?}");
    let status = status
        .unwrap_or_else(|| panic!("mpirun still ran after {limit:?} (the group hangs):\n{stderr}"));
    assert!(!status.success(), "the job must fail: {status}\n{stderr}");
    assert!(
        stderr.contains("MPI rank 0 of 2") && stderr.contains(&format!("binding 127.0.0.1:{port}")),
        "stderr names rank 0 and its port:\n{stderr}"
    );
}

/// A worker that joins MPI but never loads (stuck on a slow volume): rank
/// 0, once its own shard is loaded, waits for it up to the load deadline
/// and then ends the job non-zero, saying so. (Before: no deadline; the
/// idle rank here gives up by itself after 150 s and exits 7.)
#[test]
fn rank_0_gives_up_on_a_worker_that_never_loads() {
    if mpirun().is_none() {
        return;
    }
    let mut cmd = mpi_command(1, Some("self,tcp"));
    serve_args(&mut cmd, &["--load-timeout-secs", "3"]);
    // mpirun's ranks on this host inherit its environment (rank 0 ignores
    // this variable).
    cmd.env(IDLE_RANK_SECS, "150");
    cmd.args([":", "-np", "1"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "mpi_idle_rank",
            "--test-threads",
            "1",
            "--nocapture",
        ]);
    let (status, ran, stderr) = run_failing_group(cmd, Duration::from_secs(120));
    eprintln!("worker that never loads: {status:?} after {ran:?}");
    let status = status.unwrap_or_else(|| panic!("mpirun still ran after 120 s:\n{stderr}"));
    assert!(!status.success(), "the job must fail: {status}\n{stderr}");
    assert!(
        stderr.contains("MPI rank 0 of 2") && stderr.contains("load their shards"),
        "stderr says rank 0 gave up waiting for the others to load:\n{stderr}"
    );
}
