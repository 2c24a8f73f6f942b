//! Kimi K3's ranks as processes (MPI) against the same ranks as threads
//! of one process, side by side in one run: the verify step at 1 and
//! k + 1 rows, and what the collectives cost per step (calls, bytes,
//! time as rank 0 sees it), plus the all-reduce alone at one and k + 1
//! rows of the hidden width.
//!
//! Run: `cargo bench --features mpi --bench mpi_step -- [MODEL] [--np N]
//! [--btl self,tcp]`. MODEL is a K3 GGUF or safetensors directory (the
//! real-width slice of BENCHMARKS.md, "Kimi K3 slices"; default the tiny
//! fixture). The bench starts itself under `mpirun -np N` (default 2),
//! every process with `--threads T` threads (`RAYON_NUM_THREADS`, default
//! 1: N processes of one thread fill N cores); rank 0 also
//! loads the model as N threads, and rounds alternate processes and
//! threads so load from elsewhere hits both alike. `--btl self,tcp`
//! makes the ranks talk over TCP, as between hosts.

#[cfg(feature = "mpi")]
fn main() {
    if std::env::var_os("OMPI_COMM_WORLD_RANK").is_some() {
        ranks::run();
    } else {
        ranks::launch();
    }
}

#[cfg(not(feature = "mpi"))]
fn main() {
    println!("built without the `mpi` feature: cargo bench --features mpi --bench mpi_step");
}

#[cfg(feature = "mpi")]
mod ranks {
    use specgate_verify::model::{load_model_shard, load_model_tp, serve_worker};
    use specgate_verify::tp::MpiComm;
    use specgate_verify::{CommStats, Communicator, KvPool, LogitsWanted, Model, SeqInput};
    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::time::{Duration, Instant};

    const ROUNDS: usize = 7;
    /// Steps of each kind a round times (their median is the round's).
    const STEPS: usize = 3;
    /// Draft length of the verify step: k + 1 rows.
    const K: usize = 3;
    const PROMPT: usize = 32;
    const COLLECTIVE_REPS: usize = 200;

    fn median(mut xs: Vec<f64>) -> f64 {
        xs.sort_by(f64::total_cmp);
        xs[xs.len() / 2]
    }

    struct Args {
        model: PathBuf,
        np: usize,
        btl: Option<String>,
        threads: usize,
    }

    fn args() -> Args {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut a = Args {
            model: root.join("tests/fixtures/kimi_k3/tiny-k3.gguf"),
            np: 2,
            btl: None,
            threads: 1,
        };
        let mut it = std::env::args().skip(1);
        while let Some(x) = it.next() {
            match x.as_str() {
                "--np" => a.np = it.next().and_then(|v| v.parse().ok()).expect("--np N"),
                "--btl" => a.btl = Some(it.next().expect("--btl LIST")),
                "--threads" => {
                    a.threads = it.next().and_then(|v| v.parse().ok()).expect("--threads N")
                }
                "--bench" => {}
                other if !other.starts_with('-') => a.model = PathBuf::from(other),
                other => panic!("unknown argument {other}"),
            }
        }
        a
    }

    /// Starts this bench again as `np` ranks under mpirun and waits.
    pub fn launch() {
        let a = args();
        let exe = std::env::current_exe().unwrap();
        let mut c = Command::new("mpirun");
        c.args([
            "--allow-run-as-root",
            "--oversubscribe",
            "--bind-to",
            "none",
        ]);
        let threads = format!("RAYON_NUM_THREADS={}", a.threads);
        c.args(["-np", &a.np.to_string(), "-x", &threads]);
        if let Some(b) = &a.btl {
            c.args(["--mca", "btl", b]);
        }
        c.arg(exe).arg(&a.model).args(["--np", &a.np.to_string()]);
        c.args(["--threads", &a.threads.to_string()]);
        if let Some(b) = &a.btl {
            c.args(["--btl", b]);
        }
        let status = c.status().expect("mpirun (apt-get install openmpi-bin)");
        assert!(status.success(), "mpirun: {status}");
    }

    /// Median seconds of one all-reduce of `n` floats over `comm` (every
    /// rank runs this with the same `n`).
    fn all_reduce_secs(comm: &dyn Communicator, n: usize) -> f64 {
        let mut buf = vec![1.0f32; n];
        let mut xs = Vec::with_capacity(COLLECTIVE_REPS);
        for _ in 0..COLLECTIVE_REPS {
            let t = Instant::now();
            comm.all_reduce_sum(&mut buf).unwrap();
            xs.push(t.elapsed().as_secs_f64());
        }
        median(xs)
    }

    /// One side: a model, its pool, where its sequence stands.
    struct Side {
        name: &'static str,
        model: Model,
        pool: KvPool,
        pos: usize,
        /// Per row count (1, k + 1): step seconds and comm spent, per step.
        steps: [Vec<(f64, CommStats)>; 2],
    }

    impl Side {
        fn new(name: &'static str, model: Model) -> Side {
            let blocks = (PROMPT + ROUNDS * STEPS * (K + 2)).div_ceil(16) + 1;
            let pool = KvPool::for_model(&model, blocks, 16).unwrap();
            let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| i * 37 % 500 + 3).collect();
            let mut s = Side {
                name,
                model,
                pool,
                pos: 0,
                steps: [Vec::new(), Vec::new()],
            };
            s.step(&prompt, LogitsWanted::Last);
            s
        }

        fn step(&mut self, tokens: &[u32], logits: LogitsWanted) -> (f64, CommStats) {
            let blocks = self.pool.num_blocks() as u32;
            let table: Vec<u32> = (0..blocks).collect();
            let before = self.model.comm_stats();
            let t = Instant::now();
            self.model
                .forward(
                    &mut self.pool,
                    &[SeqInput {
                        tokens,
                        start_pos: self.pos,
                        block_table: &table,
                        logits,
                        state_slot: 0,
                    }],
                )
                .unwrap();
            let secs = t.elapsed().as_secs_f64();
            let spent = self.model.comm_stats().since(&before);
            if logits == LogitsWanted::All && self.model.has_recurrent_state() {
                // The verify pass accepted every draft.
                self.pool.keep_rows(0, tokens.len()).unwrap();
            }
            self.pos += tokens.len();
            (secs, spent)
        }

        fn round(&mut self) {
            for _ in 0..STEPS {
                let one = self.step(&[self.pos as u32 % 500 + 3], LogitsWanted::Last);
                self.steps[0].push(one);
                let rows: Vec<u32> = (0..=K as u32)
                    .map(|i| (self.pos as u32 + i) % 500 + 3)
                    .collect();
                let verify = self.step(&rows, LogitsWanted::All);
                self.steps[1].push(verify);
            }
        }
    }

    pub fn run() {
        let a = args();
        let (comm, session) =
            MpiComm::init(Duration::from_secs(600), Duration::from_secs(1)).unwrap();
        let (rank, world) = (comm.rank(), comm.world_size());
        // The collective alone, at Kimi K3's widths whatever the model:
        // the hidden state (7168) and the MoE latent (3584), at 1 and
        // k + 1 rows, and a large buffer for the bandwidth.
        let sizes = [3584, 7168, 3584 * (K + 1), 7168 * (K + 1), 1 << 20];
        let alone: Vec<f64> = sizes.iter().map(|&n| all_reduce_secs(&comm, n)).collect();
        let mut model = load_model_shard(&a.model, Box::new(comm)).unwrap();
        let hidden = model.config().hidden_size;
        if rank != 0 {
            serve_worker(&mut model).unwrap();
            drop(model);
            drop(session);
            return;
        }
        model.lead().unwrap();
        let threads = load_model_tp(&a.model, world).unwrap();
        println!(
            "model {}: hidden {hidden}; {world} ranks, {} thread(s) each; btl {}; \
             rounds {ROUNDS} x {STEPS} steps; weight bytes per decode step: rank 0's \
             shard {}, the threads' model {}",
            a.model.display(),
            a.threads,
            a.btl
                .as_deref()
                .unwrap_or("default (shared memory on one host)"),
            model.weight_bytes_per_step(),
            threads.weight_bytes_per_step()
        );
        println!("\n| all-reduce alone, floats | bytes per rank | median us | GB/s (bytes x (ranks - 1) / time) |");
        println!("|---:|---:|---:|---:|");
        for (&n, &t) in sizes.iter().zip(&alone) {
            println!(
                "| {n} | {} | {:.1} | {:.2} |",
                n * 4,
                t * 1e6,
                (n * 4 * (world - 1)) as f64 / t / 1e9
            );
        }
        let mut sides = [
            Side::new("processes (MPI)", model),
            Side::new("threads", threads),
        ];
        for r in 0..ROUNDS {
            let order: [usize; 2] = if r % 2 == 0 { [0, 1] } else { [1, 0] };
            for i in order {
                sides[i].round();
            }
        }
        println!(
            "\n| ranks as | rows | step ms (median) | collectives/step | bytes out/step | \
             bytes in/step | collective ms/step | collective share |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|");
        for s in &sides {
            for (i, rows) in [1, K + 1].iter().enumerate() {
                let steps = &s.steps[i];
                let ms = median(steps.iter().map(|x| x.0 * 1e3).collect());
                let cms = median(steps.iter().map(|x| x.1.seconds * 1e3).collect());
                let c = steps[steps.len() / 2].1;
                println!(
                    "| {} | {rows} | {ms:.2} | {} | {} | {} | {cms:.3} | {:.1}% |",
                    s.name,
                    c.calls,
                    c.bytes_out,
                    c.bytes_in,
                    100.0 * cms / ms
                );
            }
        }
        let [p, t] = [&sides[0], &sides[1]];
        for (i, rows) in [1, K + 1].iter().enumerate() {
            let mp = median(p.steps[i].iter().map(|x| x.0).collect());
            let mt = median(t.steps[i].iter().map(|x| x.0).collect());
            println!("{rows} rows: processes / threads = {:.3}x", mp / mt);
        }
        drop(sides);
        drop(session);
    }
}
