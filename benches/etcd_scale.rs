//! `EtcdBroker` at cluster scale: many client processes sharing a few slots on a 3-member etcd
//! cluster on loopback, next to a bare etcd loop run by the same processes.
//!
//! ```sh
//! cargo bench --features etcd --bench etcd_scale            # 16 processes, 8 slots, 200 jobs each
//! cargo bench --features etcd --bench etcd_scale -- --test  # CI smoke: 2 processes, 10 jobs
//! ```
//!
//! Each process (this binary run again) runs, on the parent's signal:
//! - `bare`: a create-if-absent transaction and a delete of its own key, in a loop, for a fixed
//!   time: the floor, what the cluster gives these processes without leasehold;
//! - `leases`: a `Supervisor` on an `EtcdBroker` (default settings, every member's endpoint)
//!   running all its jobs at once, each holding its slot 1–5 ms.
//!
//! The runs: bare on three members; leases without a kill; leases with one member (a follower)
//! SIGKILLed once a third of the jobs are done; bare on the two survivors (given only their
//! endpoints). It prints leases/s against the bare pairs/s, etcd calls per lease (gRPC calls and
//! messages, summed over every member's `/metrics`), slot utilisation (time slots are held ÷
//! slots × the time jobs wait) and wait percentiles.
//!
//! Knobs: `LEASEHOLD_SCALE_PROCESSES` (16), `LEASEHOLD_SCALE_SLOTS` (8), `LEASEHOLD_SCALE_JOBS`
//! (200 per process), `LEASEHOLD_SCALE_KILL` (`follower` or `leader`), `LEASEHOLD_BENCH_ROOT`
//! (where the data dirs go; default `/dev/shm`), `LEASEHOLD_ETCD_BIN`. Without an etcd binary it
//! prints a loud skip line, unless `LEASEHOLD_REQUIRE_ETCD=1`.

#[allow(dead_code, unreachable_pub)]
#[path = "../tests/etcd_support/server.rs"]
mod etcd_server;

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use etcd_server::{Cluster, bench_data_base, find_etcd, metric_sum};
use leasehold::{EtcdBroker, EtcdConfig, JobSpec, Supervisor};

const CHILD_ENV: &str = "LEASEHOLD_SCALE_CHILD";

fn main() {
    if std::env::var_os(CHILD_ENV).is_some() {
        child();
        return;
    }
    let test_mode = std::env::args().any(|a| a == "--test");
    let env_or = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let plan = Plan {
        processes: if test_mode {
            2
        } else {
            env_or("LEASEHOLD_SCALE_PROCESSES", 16)
        },
        slots: env_or("LEASEHOLD_SCALE_SLOTS", 8) as u32,
        jobs: if test_mode {
            10
        } else {
            env_or("LEASEHOLD_SCALE_JOBS", 200)
        },
        bare_for: if test_mode {
            Duration::from_millis(300)
        } else {
            Duration::from_secs(3)
        },
        kill_leader: std::env::var("LEASEHOLD_SCALE_KILL").as_deref() == Ok("leader"),
    };
    let Some(bin) = find_etcd(None) else {
        if std::env::var("LEASEHOLD_REQUIRE_ETCD").as_deref() == Ok("1") {
            panic!(
                "LEASEHOLD_REQUIRE_ETCD=1 but no etcd binary was found (apt-get install etcd-server)"
            );
        }
        eprintln!("\n*** SKIPPED etcd_scale: no etcd binary (apt-get install etcd-server) ***\n");
        return;
    };
    run(&bin, &plan, test_mode);
}

struct Plan {
    processes: usize,
    slots: u32,
    jobs: usize,
    bare_for: Duration,
    kill_leader: bool,
}

fn run(bin: &Path, plan: &Plan, test_mode: bool) {
    let mut cluster = Cluster::start_in(bin, 3, bench_data_base().as_deref());
    let all = cluster.endpoints();
    let work = tempfile::tempdir().expect("scratch dir");
    let mut procs: Vec<Proc> = (0..plan.processes).map(Proc::spawn).collect();
    println!(
        "etcd_scale: {} processes, {} slots, {} jobs each (holds 1-5 ms), 3-member etcd {} on loopback, data under {}",
        plan.processes,
        plan.slots,
        plan.jobs,
        etcd_version(bin),
        bench_data_base().map_or("the temp dir".into(), |p| p.display().to_string()),
    );

    let bare3 = bare(&mut procs, &mut cluster, &all, plan);
    let calm = leases(
        &mut procs,
        &mut cluster,
        &all,
        plan,
        "leases",
        "scale-calm",
        work.path(),
        None,
    );
    let direct = leases(
        &mut procs,
        &mut cluster,
        &all,
        plan,
        "broker",
        "scale-direct",
        work.path(),
        None,
    );
    let victim = if plan.kill_leader {
        cluster.wait_leader(Duration::from_secs(10))
    } else {
        (cluster.wait_leader(Duration::from_secs(10)) + 1) % 3
    };
    let killed = leases(
        &mut procs,
        &mut cluster,
        &all,
        plan,
        "leases",
        "scale-kill",
        work.path(),
        Some(victim),
    );
    let live: Vec<String> = (0..3)
        .filter(|i| *i != victim)
        .map(|i| cluster.endpoint(i))
        .collect();
    let bare2 = bare(&mut procs, &mut cluster, &live, plan);
    for p in &mut procs {
        p.send("quit");
    }

    println!();
    if test_mode {
        println!("(test mode: a smoke run, not a measurement)");
    }
    let who = if plan.kill_leader {
        "leader"
    } else {
        "follower"
    };
    println!(
        "| run | leases/s | bare pairs/s | leases / bare | etcd calls / lease | messages / lease | slot utilisation | wait p50 / p99 | CPU ms / lease (clients + etcd) | failed |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    println!(
        "| bare loop, 3 members | – | {:.0} | – | {:.2} per pair | {:.2} per pair | – | – | {:.2} + {:.2} per pair | – |",
        bare3.rate, bare3.calls_per_pair, bare3.msgs_per_pair, bare3.cpu_ms.0, bare3.cpu_ms.1
    );
    calm.row("leases, no kill", bare3.rate);
    direct.row("↳ the broker alone (no supervisor), no kill", bare3.rate);
    killed.row(&format!("leases, {who} killed at 1/3"), bare3.rate);
    if let Some(after) = &killed.after_kill {
        println!(
            "| ↳ after the kill only | {:.0} | {:.0} (2 survivors) | {:.3}× | – | – | – | – | – | – |",
            after,
            bare2.rate,
            after / bare2.rate
        );
    }
    println!(
        "| bare loop, 2 survivors | – | {:.0} | – | {:.2} per pair | {:.2} per pair | – | – | {:.2} + {:.2} per pair | – |",
        bare2.rate, bare2.calls_per_pair, bare2.msgs_per_pair, bare2.cpu_ms.0, bare2.cpu_ms.1
    );
    let kill_ratio = killed.after_kill.unwrap_or(killed.rate) / bare2.rate;
    let calm_ratio = calm.rate / bare3.rate;
    println!();
    println!(
        "target ≥ 0.5× the bare loop: no kill {:.3}× ({}), {who} killed {:.3}× after the kill vs the survivors' bare loop ({})",
        calm_ratio,
        if calm_ratio >= 0.5 { "met" } else { "missed" },
        kill_ratio,
        if kill_ratio >= 0.5 { "met" } else { "missed" },
    );
    println!(
        "failover: the lease/bare ratio after the kill is {:.2}× the one without a kill (target ≥ 0.9×)",
        kill_ratio / calm_ratio
    );
    let failed = calm.failed + killed.failed;
    assert!(
        failed == 0 || !test_mode,
        "{failed} jobs failed in the smoke run"
    );
}

fn etcd_version(bin: &Path) -> String {
    Command::new(bin)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| {
            s.lines()
                .next()
                .map(|l| l.trim_start_matches("etcd Version: ").to_owned())
        })
        .unwrap_or_else(|| "?".into())
}

/// CPU seconds (user + system) used so far by the processes `pids`, from `/proc`.
fn cpu_seconds(pids: &[u32]) -> f64 {
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|stat| {
            // Fields after the command name (which is in parentheses): utime is the 14th field
            // of the whole line, stime the 15th.
            let rest = stat.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?)
        })
        .sum::<f64>()
        / 100.0
}

/// CPU seconds of the client processes and of the etcd members so far.
fn cpu(procs: &[Proc], cluster: &Cluster) -> (f64, f64) {
    let clients: Vec<u32> = procs.iter().map(|p| p.child.id()).collect();
    let members: Vec<u32> = (0..3).filter_map(|i| cluster.pid(i)).collect();
    (cpu_seconds(&clients), cpu_seconds(&members))
}

/// gRPC calls and messages received, summed over the members that answer.
fn grpc_counts(cluster: &Cluster, members: &[usize]) -> (f64, f64) {
    members
        .iter()
        .filter_map(|i| cluster.metrics(*i).ok())
        .map(|m| {
            (
                metric_sum(&m, "grpc_server_started_total"),
                metric_sum(&m, "grpc_server_msg_received_total"),
            )
        })
        .fold((0.0, 0.0), |(a, b), (c, d)| (a + c, b + d))
}

struct Bare {
    rate: f64,
    calls_per_pair: f64,
    msgs_per_pair: f64,
    /// CPU ms per pair: the client processes, the etcd members.
    cpu_ms: (f64, f64),
}

fn bare(procs: &mut [Proc], cluster: &mut Cluster, endpoints: &[String], plan: &Plan) -> Bare {
    let members: Vec<usize> = (0..3)
        .filter(|i| endpoints.contains(&cluster.endpoint(*i)))
        .collect();
    let joined = endpoints.join(",");
    for p in procs.iter_mut() {
        p.send(&format!("bare {joined} {}", plan.bare_for.as_millis()));
    }
    for p in procs.iter_mut() {
        p.expect("READY");
    }
    let (calls0, msgs0) = grpc_counts(cluster, &members);
    let cpu0 = cpu(procs, cluster);
    for p in procs.iter_mut() {
        p.send("go");
    }
    let mut pairs = 0u64;
    for p in procs.iter_mut() {
        let line = p.expect("BARE");
        pairs += line.split(' ').nth(1).unwrap().parse::<u64>().unwrap();
    }
    let (calls1, msgs1) = grpc_counts(cluster, &members);
    let cpu1 = cpu(procs, cluster);
    let (calls, msgs) = (calls1 - calls0, msgs1 - msgs0);
    let n = pairs.max(1) as f64;
    Bare {
        rate: pairs as f64 / plan.bare_for.as_secs_f64(),
        calls_per_pair: calls / n,
        msgs_per_pair: msgs / n,
        cpu_ms: ((cpu1.0 - cpu0.0) * 1e3 / n, (cpu1.1 - cpu0.1) * 1e3 / n),
    }
}

struct Leases {
    rate: f64,
    after_kill: Option<f64>,
    calls_per_lease: f64,
    msgs_per_lease: f64,
    utilisation: f64,
    wait_p50: Duration,
    wait_p99: Duration,
    failed: usize,
    /// CPU ms per lease: the client processes, the etcd members.
    cpu_ms: (f64, f64),
}

impl Leases {
    fn row(&self, label: &str, bare: f64) {
        println!(
            "| {label} | {:.0} | {:.0} | {:.3}× | {:.2} | {:.2} | {:.1}% | {:.0} ms / {:.0} ms | {:.2} + {:.2} | {} |",
            self.rate,
            bare,
            self.rate / bare,
            self.calls_per_lease,
            self.msgs_per_lease,
            self.utilisation * 100.0,
            self.wait_p50.as_secs_f64() * 1e3,
            self.wait_p99.as_secs_f64() * 1e3,
            self.cpu_ms.0,
            self.cpu_ms.1,
            self.failed,
        );
    }
}

/// One hold as a job recorded it: submitted, granted (body start), released (body end), in ns.
struct Hold {
    submit: u128,
    start: u128,
    end: u128,
    slot: u128,
}

fn read_holds(dir: &Path) -> Vec<Hold> {
    let mut holds = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let mut text = String::new();
        File::open(entry.path())
            .and_then(|mut f| f.read_to_string(&mut text))
            .unwrap();
        for line in text.lines() {
            let f: Vec<u128> = line.split(' ').map(|v| v.parse().unwrap()).collect();
            holds.push(Hold {
                submit: f[0],
                start: f[1],
                end: f[2],
                slot: f[3],
            });
        }
    }
    holds
}

/// One lease run: `mode` is `leases` (jobs through a supervisor) or `broker` (the broker
/// driven directly by `slots` tasks per process, as many as a supervisor keeps in flight).
#[allow(clippy::too_many_arguments)]
fn leases(
    procs: &mut [Proc],
    cluster: &mut Cluster,
    endpoints: &[String],
    plan: &Plan,
    mode: &str,
    pool: &str,
    work: &Path,
    kill: Option<usize>,
) -> Leases {
    let dir = work.join(pool);
    std::fs::create_dir_all(&dir).unwrap();
    let joined = endpoints.join(",");
    for (i, p) in procs.iter_mut().enumerate() {
        p.send(&format!(
            "{mode} {joined} {pool} {} {} {}",
            plan.slots,
            plan.jobs,
            dir.join(format!("p{i}")).display()
        ));
    }
    for p in procs.iter_mut() {
        p.expect("READY");
    }
    let members: Vec<usize> = (0..3).collect();
    let (calls0, msgs0) = grpc_counts(cluster, &members);
    let cpu0 = cpu(procs, cluster);
    let go = now_ns();
    let started = Instant::now();
    for p in procs.iter_mut() {
        p.send("go");
    }
    let total = plan.processes * plan.jobs;
    let mut before_kill = (0.0, 0.0);
    let mut victim_cpu = 0.0;
    let mut killed_at = None;
    if let Some(victim) = kill {
        // A third of the jobs done: the member dies.
        loop {
            let done: usize = std::fs::read_dir(&dir)
                .unwrap()
                .flatten()
                .map(|e| {
                    std::fs::read(e.path()).map_or(0, |b| b.iter().filter(|c| **c == b'\n').count())
                })
                .sum();
            if done >= total / 3 {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        before_kill = grpc_counts(cluster, &[victim]);
        victim_cpu = cpu_seconds(&cluster.pid(victim).into_iter().collect::<Vec<_>>());
        cluster.kill9(victim);
        killed_at = Some((now_ns(), Instant::now()));
    }
    let mut failed = 0;
    for p in procs.iter_mut() {
        let line = p.expect("LEASES");
        let f: Vec<&str> = line.split(' ').collect();
        failed += f[2].parse::<usize>().unwrap();
    }
    let wall = started.elapsed();
    let cpu1 = cpu(procs, cluster);
    if std::env::var_os("LEASEHOLD_SCALE_METRICS").is_some() {
        for i in (0..3).filter(|i| Some(*i) != kill) {
            if let Ok(m) = cluster.metrics(i) {
                for name in [
                    "etcd_server_proposals_committed_total",
                    "etcd_mvcc_put_total",
                    "etcd_mvcc_delete_total",
                    "etcd_mvcc_txn_total",
                    "etcd_mvcc_range_total",
                    "etcd_debugging_mvcc_watcher_total",
                    "etcd_debugging_mvcc_slow_watcher_total",
                    "etcd_debugging_mvcc_events_total",
                    "etcd_debugging_mvcc_pending_events_total",
                ] {
                    eprintln!("METRIC {pool} m{i} {name} {}", metric_sum(&m, name));
                }
                for line in m
                    .lines()
                    .filter(|l| l.starts_with("grpc_server_started_total{"))
                {
                    eprintln!("METRIC {pool} m{i} {line}");
                }
            }
        }
    }
    let alive: Vec<usize> = members
        .iter()
        .copied()
        .filter(|i| Some(*i) != kill)
        .collect();
    let (calls1, msgs1) = grpc_counts(cluster, &alive);
    let (calls, msgs) = (
        calls1 + before_kill.0 - calls0,
        msgs1 + before_kill.1 - msgs0,
    );
    let holds = read_holds(&dir);
    let n = holds.len().max(1) as f64;
    // Utilisation while jobs wait: from the start to the last grant.
    let last_grant = holds.iter().map(|h| h.start).max().unwrap_or(go);
    let window = last_grant.saturating_sub(go).max(1) as f64;
    let busy: f64 = holds
        .iter()
        .map(|h| h.end.min(last_grant).saturating_sub(h.start.max(go)) as f64)
        .sum();
    let mut waits: Vec<u128> = holds
        .iter()
        .map(|h| h.start.saturating_sub(h.submit))
        .collect();
    waits.sort_unstable();
    let pct = |q: f64| {
        Duration::from_nanos(
            waits
                .get(((waits.len() as f64 - 1.0) * q) as usize)
                .copied()
                .unwrap_or(0) as u64,
        )
    };
    // The hand-off gap: from a job's end to the next job's start on the same slot.
    let mut by_slot: HashMap<u128, Vec<(u128, u128)>> = HashMap::new();
    for h in &holds {
        by_slot.entry(h.slot).or_default().push((h.start, h.end));
    }
    let mut gaps: Vec<u128> = by_slot
        .values_mut()
        .flat_map(|v| {
            v.sort_unstable();
            v.windows(2)
                .map(|w| w[1].0.saturating_sub(w[0].1))
                .collect::<Vec<_>>()
        })
        .collect();
    gaps.sort_unstable();
    let gap = |q: f64| {
        gaps.get(((gaps.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or(0) as f64
            / 1e6
    };
    println!(
        "{pool}: hand-off gap (a job's end to the next start on its slot) p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms",
        gap(0.5),
        gap(0.9),
        gap(0.99)
    );
    let after_kill = killed_at.map(|(at_ns, at)| {
        let after = holds.iter().filter(|h| h.end > at_ns).count();
        after as f64 / (started + wall - at).as_secs_f64()
    });
    Leases {
        rate: holds.len() as f64 / wall.as_secs_f64(),
        after_kill,
        calls_per_lease: calls / n,
        msgs_per_lease: msgs / n,
        utilisation: busy / (f64::from(plan.slots) * window),
        wait_p50: pct(0.5),
        wait_p99: pct(0.99),
        failed,
        cpu_ms: (
            (cpu1.0 - cpu0.0) * 1e3 / n,
            (cpu1.1 + victim_cpu - cpu0.1) * 1e3 / n,
        ),
    }
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// A child process and its pipes.
struct Proc {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Proc {
    fn spawn(index: usize) -> Proc {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env(CHILD_ENV, index.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn a client process");
        let stdin = child.stdin.take().unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc {
            child,
            stdin,
            lines,
        }
    }

    fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("write to a client process");
        self.stdin.flush().unwrap();
    }

    fn expect(&mut self, prefix: &str) -> String {
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(300))
                .unwrap_or_else(|e| panic!("no {prefix} from a client process: {e}"));
            if line.starts_with(prefix) {
                return line;
            }
            eprintln!("client: {line}");
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// The client process

fn child() {
    let index: u64 = std::env::var(CHILD_ENV).unwrap().parse().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let stdin = std::io::stdin();
    let mut commands = stdin.lock().lines().map_while(Result::ok);
    let say = |line: String| {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}").unwrap();
        out.flush().unwrap();
    };
    while let Some(cmd) = commands.next() {
        let f: Vec<&str> = cmd.split(' ').collect();
        match f.as_slice() {
            ["bare", endpoints, millis] => {
                let endpoints: Vec<&str> = endpoints.split(',').collect();
                let bound = Duration::from_millis(millis.parse().unwrap());
                let client = rt
                    .block_on(etcd_client::Client::connect(&endpoints, None))
                    .expect("connect");
                say("READY".into());
                assert_eq!(commands.next().as_deref(), Some("go"));
                let pairs = rt.block_on(bare_loop(client, index, bound));
                say(format!("BARE {pairs}"));
            }
            ["leases", endpoints, pool, slots, jobs, file] => {
                let endpoints: Vec<String> = endpoints.split(',').map(str::to_owned).collect();
                let config = EtcdConfig::new(&endpoints, *pool, slots.parse().unwrap());
                let sup = rt.block_on(async {
                    let broker = EtcdBroker::connect(config).await.expect("broker connects");
                    Supervisor::builder()
                        .broker(broker)
                        .start()
                        .await
                        .expect("start")
                });
                say("READY".into());
                assert_eq!(commands.next().as_deref(), Some("go"));
                let jobs: usize = jobs.parse().unwrap();
                let (ok, failed) = rt.block_on(run_jobs(&sup, index, jobs, Path::new(file)));
                rt.block_on(sup.shutdown()).expect("shutdown");
                say(format!("LEASES {ok} {failed}"));
            }
            ["broker", endpoints, pool, slots, jobs, file] => {
                let endpoints: Vec<String> = endpoints.split(',').map(str::to_owned).collect();
                let slots: u32 = slots.parse().unwrap();
                let config = EtcdConfig::new(&endpoints, *pool, slots);
                let broker = rt
                    .block_on(EtcdBroker::connect(config))
                    .expect("broker connects");
                say("READY".into());
                assert_eq!(commands.next().as_deref(), Some("go"));
                let jobs: usize = jobs.parse().unwrap();
                let (ok, failed) = rt.block_on(run_broker(
                    Arc::new(broker),
                    index,
                    jobs,
                    slots as usize,
                    Path::new(file),
                ));
                say(format!("LEASES {ok} {failed}"));
            }
            ["quit"] => return,
            other => panic!("unknown command {other:?}"),
        }
    }
}

/// Create-if-absent and delete of this process's own key, for `bound`; returns the pairs done.
async fn bare_loop(mut client: etcd_client::Client, index: u64, bound: Duration) -> u64 {
    let key = format!("bench-bare/{index}");
    let value = "leasehold/v1 holder request=0123456789abcdef";
    let create = Txn::new()
        .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key.clone(), value, None)]);
    let started = Instant::now();
    let mut pairs = 0;
    while started.elapsed() < bound {
        client.txn(create.clone()).await.expect("bare create");
        client.delete(key.clone(), None).await.expect("bare delete");
        pairs += 1;
    }
    pairs
}

/// All `jobs` jobs at once, each holding its slot 1–5 ms; every hold goes to `file` as
/// `submit start end` (ns). Returns (succeeded, failed).
async fn run_jobs(sup: &Supervisor, index: u64, jobs: usize, file: &Path) -> (usize, usize) {
    let out = Arc::new(std::sync::Mutex::new(
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(file)
            .expect("open the holds file"),
    ));
    let mut set = tokio::task::JoinSet::new();
    let mut seed = index.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for j in 0..jobs {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let hold = Duration::from_micros(1_000 + seed % 4_001);
        let (sup, out) = (sup.clone(), Arc::clone(&out));
        let submit = now_ns();
        set.spawn(async move {
            sup.run(
                JobSpec::new(format!("p{index}-{j}")).unwrap(),
                move |ctx| async move {
                    let start = now_ns();
                    tokio::time::sleep(hold).await;
                    let end = now_ns();
                    let mut out = out.lock().unwrap();
                    writeln!(out, "{submit} {start} {end} {}", ctx.slot_id()).unwrap();
                    Ok::<_, String>(())
                },
            )
            .await
        });
    }
    let mut outcome: HashMap<bool, usize> = HashMap::new();
    while let Some(done) = set.join_next().await {
        let ok = matches!(done, Ok(Ok(())));
        if !ok {
            eprintln!("job failed: {done:?}");
        }
        *outcome.entry(ok).or_default() += 1;
    }
    (
        outcome.get(&true).copied().unwrap_or(0),
        outcome.get(&false).copied().unwrap_or(0),
    )
}

/// `jobs` leases on the broker directly, by `tasks` tasks (each: acquire, hold 1–5 ms,
/// release), recorded like `run_jobs`. Returns (succeeded, failed).
async fn run_broker(
    broker: Arc<EtcdBroker>,
    index: u64,
    jobs: usize,
    tasks: usize,
    file: &Path,
) -> (usize, usize) {
    use leasehold::{AcquireRequest, SlotBroker};
    let out = Arc::new(std::sync::Mutex::new(
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(file)
            .expect("open the holds file"),
    ));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut set = tokio::task::JoinSet::new();
    for t in 0..tasks {
        let (broker, out, next) = (Arc::clone(&broker), Arc::clone(&out), Arc::clone(&next));
        set.spawn(async move {
            let mut seed = (index * 1000 + t as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let (mut ok, mut failed) = (0, 0);
            loop {
                let j = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if j >= jobs {
                    return (ok, failed);
                }
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let hold = Duration::from_micros(1_000 + seed % 4_001);
                let submit = now_ns();
                match broker
                    .acquire(AcquireRequest::new(j as u64 + 1, None))
                    .await
                {
                    Ok(token) => {
                        let start = now_ns();
                        tokio::time::sleep(hold).await;
                        let end = now_ns();
                        writeln!(
                            out.lock().unwrap(),
                            "{submit} {start} {end} {}",
                            token.slot_id()
                        )
                        .unwrap();
                        if broker.release(token).await.is_ok() {
                            ok += 1;
                        } else {
                            failed += 1;
                        }
                    }
                    Err(e) => {
                        eprintln!("acquire failed: {e}");
                        failed += 1;
                    }
                }
            }
        });
    }
    let (mut ok, mut failed) = (0, 0);
    while let Some(done) = set.join_next().await {
        let (o, f) = done.unwrap();
        ok += o;
        failed += f;
    }
    (ok, failed)
}
