//! `EtcdBroker` at cluster scale: many client processes sharing a few slots on a 3-member etcd
//! cluster on loopback, next to a bare etcd loop and to etcd's own v3 Lock service, run by the
//! same processes through the same proxies.
//!
//! ```sh
//! cargo bench -p leasehold-etcd --bench etcd_scale            # 16 processes, 8 slots, 200 jobs each
//! cargo bench -p leasehold-etcd --bench etcd_scale -- --test  # CI smoke: 2 processes, 10 jobs
//! ```
//!
//! Every client reaches every member through the bench's own delay proxy (one per member, in
//! this process: kernel netem is not available on these machines), which delivers each chunk D
//! ms after it read it and counts the bytes. Each delay (D = 0 and D = 5 ms by default) runs:
//! - `bare`: a create-if-absent transaction and a delete of the process's own key, in a loop,
//!   for a fixed time: the floor, what the cluster gives these processes without leasehold;
//! - `leases`: a `Supervisor` on an `EtcdBroker` (default settings, every member's endpoint)
//!   per process, running all its jobs at once, each holding its slot 1–5 ms;
//! - `broker`: the same leases on the broker alone, driven by as many tasks per process as a
//!   supervisor keeps acquires in flight (acquire, hold, release);
//! - one slot: `leases` and `broker` on a pool of one slot, and etcd's v3 Lock service
//!   (`Lock`, hold, `Unlock`, one task per process, each process on its own session lease),
//!   the same holds.
//!
//! Then, at D = 0, leases with one member (a follower, or the leader) SIGKILLed once a third of
//! the jobs are done, and the bare loop on the two survivors.
//!
//! For each phase it prints: leases/s; the members' CPU per lease (user + system of each member
//! from `/proc/<pid>/stat` over the phase) and its ratio to a bare pair's; etcd calls per lease
//! (summed over every member's `/metrics`) and bytes on the wire per lease (up, down: counted by
//! the proxies); acquire latency p50 / p99 (asked to granted; through a supervisor, from the
//! job's submission, which includes waiting behind the process's other jobs); the hand-off p50
//! / p99 (on each slot, from one holder's release to the next waiter's grant, where the next was
//! already waiting), also in round trips (2 × D); the keys left under the pool afterwards (only
//! its capacity record may be). A profile line per phase gives the calls by method, the watch
//! stream messages, the watch events sent and the raft proposals per lease.
//!
//! Knobs: `LEASEHOLD_SCALE_PROCESSES` (16), `LEASEHOLD_SCALE_SLOTS` (8), `LEASEHOLD_SCALE_JOBS`
//! (200 per process), `LEASEHOLD_SCALE_ONE_SLOT_JOBS` (25 per process), `LEASEHOLD_SCALE_DELAYS`
//! (`0,5`, one-way ms), `LEASEHOLD_SCALE_KILL` (`follower`, `leader` or `none`),
//! `LEASEHOLD_BENCH_ROOT` (where the data dirs go; default `/dev/shm`), `LEASEHOLD_ETCD_BIN`.
//! Without an etcd binary it prints a loud skip line, unless `LEASEHOLD_REQUIRE_ETCD=1`.

#[allow(dead_code, unreachable_pub)]
#[path = "../tests/etcd_support/server.rs"]
mod etcd_server;
#[path = "etcd_scale/measure.rs"]
mod measure;
#[path = "etcd_scale/pprof.rs"]
mod pprof;
#[path = "etcd_scale/proxy.rs"]
mod proxy;

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use etcd_client::{Compare, CompareOp, GetOptions, LockOptions, Txn, TxnOp};
use etcd_server::{Cluster, bench_data_base, find_etcd};
use leasehold::{JobSpec, Supervisor};
use leasehold_etcd::{EtcdBroker, EtcdConfig};
use measure::{Counters, Hold, acquire_latencies, cpu_seconds, hand_offs, quantile_ms, read_holds};
use proxy::DelayProxy;

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
        one_slot_jobs: if test_mode {
            4
        } else {
            env_or("LEASEHOLD_SCALE_ONE_SLOT_JOBS", 25)
        },
        bare_for: if test_mode {
            Duration::from_millis(300)
        } else {
            Duration::from_secs(3)
        },
        delays: std::env::var("LEASEHOLD_SCALE_DELAYS")
            .ok()
            .map(|v| {
                v.split(',')
                    .map(|d| {
                        d.trim()
                            .parse()
                            .expect("LEASEHOLD_SCALE_DELAYS: ms, comma-separated")
                    })
                    .collect()
            })
            .unwrap_or_else(|| vec![0, 5]),
        kill: match std::env::var("LEASEHOLD_SCALE_KILL").as_deref() {
            Ok("leader") => Kill::Leader,
            Ok("none") => Kill::None,
            _ => Kill::Follower,
        },
        profile_seconds: if test_mode {
            1
        } else {
            env_or("LEASEHOLD_SCALE_PPROF_SECONDS", 4) as u64
        },
        profile_dir: std::env::var_os("LEASEHOLD_SCALE_PPROF").map(PathBuf::from),
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
    one_slot_jobs: usize,
    bare_for: Duration,
    /// One-way delays (ms) to run every phase at.
    delays: Vec<u64>,
    kill: Kill,
    /// How long each profiled phase's members are profiled (from its start; 0: not at all).
    profile_seconds: u64,
    /// Where the profiles are kept (every phase is then profiled); else a scratch dir, and only
    /// the phases whose split is printed.
    profile_dir: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kill {
    Follower,
    Leader,
    None,
}

/// The proxies of one delay, one per member.
struct Net {
    delay: Duration,
    proxies: Vec<DelayProxy>,
}

impl Net {
    fn start(rt: &tokio::runtime::Handle, cluster: &Cluster, delay_ms: u64) -> Net {
        let delay = Duration::from_millis(delay_ms);
        let proxies = (0..cluster.len())
            .map(|i| {
                let target = SocketAddr::from(([127, 0, 0, 1], cluster.client_port(i)));
                DelayProxy::start(rt, target, delay)
            })
            .collect();
        Net { delay, proxies }
    }

    fn endpoints(&self, members: &[usize]) -> String {
        members
            .iter()
            .map(|i| self.proxies[*i].endpoint())
            .collect::<Vec<_>>()
            .join(",")
    }

    fn bytes(&self) -> (u64, u64) {
        self.proxies
            .iter()
            .map(DelayProxy::bytes)
            .fold((0, 0), |(a, b), (c, d)| (a + c, b + d))
    }
}

/// What one phase measured.
struct Figures {
    label: String,
    /// Leases (or bare pairs) done.
    n: usize,
    rate: f64,
    /// CPU ms per lease (or pair): the etcd members, the client processes.
    members_cpu_ms: f64,
    clients_cpu_ms: f64,
    counters: Counters,
    /// Bytes per lease (or pair), up (client to member) and down.
    bytes: (f64, f64),
    /// Sorted, ns.
    acquire: Vec<u128>,
    hand_off: Vec<u128>,
    failed: usize,
    /// Keys under the pool afterwards, besides its capacity record.
    left: Option<i64>,
    /// Leases/s after a member was killed.
    after_kill: Option<f64>,
    /// The members' CPU by request type (their pprof profiles over the phase's first seconds).
    split: Option<pprof::Split>,
}

impl Figures {
    fn calls(&self) -> f64 {
        self.counters.total_calls() / self.n.max(1) as f64
    }

    fn row(&self, bare: Option<&Figures>, delay: Duration) {
        let per = |v: &[u128]| {
            if v.is_empty() {
                "–".to_owned()
            } else {
                format!(
                    "{:.1} / {:.1} ms",
                    quantile_ms(v, 0.5),
                    quantile_ms(v, 0.99)
                )
            }
        };
        let rtt = 2.0 * delay.as_secs_f64() * 1e3;
        let hand_off_rtt = if self.hand_off.is_empty() || rtt == 0.0 {
            "–".to_owned()
        } else {
            format!(
                "{:.2} / {:.2}",
                quantile_ms(&self.hand_off, 0.5) / rtt,
                quantile_ms(&self.hand_off, 0.99) / rtt
            )
        };
        let ratio = bare.map_or("–".to_owned(), |b| {
            format!("{:.2}×", self.members_cpu_ms / b.members_cpu_ms)
        });
        println!(
            "| {} | {:.0} | {:.2} ms | {} | {:.2} | {:.0} + {:.0} | {} | {} | {} | {:.2} ms | {} | {} |",
            self.label,
            self.rate,
            self.members_cpu_ms,
            ratio,
            self.calls(),
            self.bytes.0,
            self.bytes.1,
            per(&self.acquire),
            per(&self.hand_off),
            hand_off_rtt,
            self.clients_cpu_ms,
            self.failed,
            self.left.map_or("–".to_owned(), |l| l.to_string()),
        );
    }
}

/// Everything measured at one delay.
struct AtDelay {
    delay: Duration,
    bare: Figures,
    leases: Figures,
    broker: Figures,
    one_slot: Figures,
    /// The broker alone at one slot (one task per process).
    one_broker: Figures,
    lock: Figures,
    /// A unary call's round trip through the proxies (a serializable read), p50 ms.
    call_ms: f64,
}

fn run(bin: &Path, plan: &Plan, test_mode: bool) {
    // Every member serves its CPU profile: the phases below are profiled (see `profile`).
    let mut cluster = Cluster::start_with(bin, 3, bench_data_base().as_deref(), true);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let work = tempfile::tempdir().expect("scratch dir");
    let mut procs: Vec<Proc> = (0..plan.processes).map(Proc::spawn).collect();
    println!(
        "etcd_scale: {} processes, {} slots, {} jobs each (holds 1-5 ms; {} each on one slot), 3-member etcd {} on loopback, data under {}, delays {:?} ms one way",
        plan.processes,
        plan.slots,
        plan.jobs,
        plan.one_slot_jobs,
        etcd_version(bin),
        bench_data_base().map_or("the temp dir".into(), |p| p.display().to_string()),
        plan.delays,
    );
    let all = [0, 1, 2];
    let mut results = Vec::new();
    for &d in &plan.delays {
        let net = Net::start(rt.handle(), &cluster, d);
        let call_ms = call_round_trip(&rt, &net.endpoints(&[0]));
        let p = |mode: &str, slots: u32, jobs: usize, label: &str| Phase {
            mode: mode.to_owned(),
            pool: format!("scale-d{d}-{mode}-{slots}"),
            slots,
            jobs,
            label: label.to_owned(),
            kill: None,
            // In a smoke run, the main figure's only (its phases are shorter than a profile).
            profile: plan.profile_dir.is_some()
                || (mode != "broker" && !(test_mode && (mode != "leases" || slots == 1))),
        };
        let bare = bare(
            &mut procs,
            &cluster,
            &net,
            &all,
            plan,
            "bare loop, 3 members",
            !test_mode || plan.profile_dir.is_some(),
            &work,
        );
        let leases = phase(
            &mut procs,
            &mut cluster,
            &net,
            &rt,
            &work,
            plan,
            &p("leases", plan.slots, plan.jobs, "leasehold (supervisor)"),
        );
        let broker = phase(
            &mut procs,
            &mut cluster,
            &net,
            &rt,
            &work,
            plan,
            &p("broker", plan.slots, plan.jobs, "↳ the broker alone"),
        );
        let one_slot = phase(
            &mut procs,
            &mut cluster,
            &net,
            &rt,
            &work,
            plan,
            &p("leases", 1, plan.one_slot_jobs, "one slot: leasehold"),
        );
        let one_broker = phase(
            &mut procs,
            &mut cluster,
            &net,
            &rt,
            &work,
            plan,
            &p("broker", 1, plan.one_slot_jobs, "↳ the broker alone"),
        );
        let lock = phase(
            &mut procs,
            &mut cluster,
            &net,
            &rt,
            &work,
            plan,
            &p("lock", 1, plan.one_slot_jobs, "one slot: etcd v3 Lock"),
        );
        results.push(AtDelay {
            delay: net.delay,
            bare,
            leases,
            broker,
            one_slot,
            one_broker,
            lock,
            call_ms,
        });
    }
    // The member kill, last (the cluster stays down a member), without delay.
    let killed = (plan.kill != Kill::None).then(|| {
        let net = Net::start(rt.handle(), &cluster, 0);
        let leader = cluster.wait_leader(Duration::from_secs(10));
        let victim = if plan.kill == Kill::Leader {
            leader
        } else {
            (leader + 1) % 3
        };
        let who = if plan.kill == Kill::Leader {
            "leader"
        } else {
            "follower"
        };
        let killed = phase(
            &mut procs,
            &mut cluster,
            &net,
            &rt,
            &work,
            plan,
            &Phase {
                mode: "leases".into(),
                pool: "scale-kill".into(),
                slots: plan.slots,
                jobs: plan.jobs,
                label: format!("leasehold, {who} killed at 1/3 (D = 0)"),
                kill: Some(victim),
                profile: false,
            },
        );
        let live: Vec<usize> = all.iter().copied().filter(|i| *i != victim).collect();
        let bare2 = bare(
            &mut procs,
            &cluster,
            &net,
            &live,
            plan,
            "bare loop, 2 survivors",
            false,
            &work,
        );
        (killed, bare2)
    });
    for p in &mut procs {
        p.send("quit");
    }

    println!();
    if test_mode {
        println!("(test mode: a smoke run, not a measurement)");
    }
    println!(
        "Members' CPU: user + system of the 3 etcd members over the phase, per lease (per pair for the bare loop). Bytes: on the wire through the proxies, per lease. Acquire: asked to granted (through a supervisor: from the job's submission). Hand-off: one holder's release to the next waiter's grant on its slot; in round trips of 2 × D."
    );
    for r in &results {
        println!();
        println!(
            "D = {} ms one way (a serializable read through the proxy: {:.2} ms p50)",
            r.delay.as_millis(),
            r.call_ms
        );
        println!(
            "| phase | leases/s | members' CPU / lease | ÷ bare pair | etcd calls / lease | bytes / lease (up + down) | acquire p50 / p99 | hand-off p50 / p99 | hand-off in RTT p50 / p99 | clients' CPU / lease | failed | keys left |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
        r.bare.row(None, r.delay);
        for f in [&r.leases, &r.broker, &r.one_slot, &r.one_broker, &r.lock] {
            f.row(Some(&r.bare), r.delay);
        }
        println!(
            "one slot, {} processes: leasehold {:.0} leases/s (the broker alone {:.0}) against the v3 Lock service's {:.0}: {:.2}× ({:.2}×)",
            plan.processes,
            r.one_slot.rate,
            r.one_broker.rate,
            r.lock.rate,
            r.one_slot.rate / r.lock.rate,
            r.one_broker.rate / r.lock.rate
        );
        for f in [
            &r.bare,
            &r.leases,
            &r.broker,
            &r.one_slot,
            &r.one_broker,
            &r.lock,
        ] {
            println!(
                "profile, {} per {}: {}",
                f.label,
                if f.label.starts_with("bare") {
                    "pair"
                } else {
                    "lease"
                },
                f.counters.profile(f.n.max(1) as f64)
            );
        }
        for f in [&r.bare, &r.leases, &r.one_slot, &r.lock] {
            if let Some(split) = &f.split {
                println!(
                    "members' CPU by request type, {} (pprof of the 3 members over the first {} s; share, and ms per {}): {}",
                    f.label,
                    if f.label.starts_with("bare") {
                        plan.bare_for
                            .as_secs()
                            .max(1)
                            .min(plan.profile_seconds.max(1))
                    } else {
                        plan.profile_seconds
                    },
                    if f.label.starts_with("bare") {
                        "pair"
                    } else {
                        "lease"
                    },
                    split.line(f.members_cpu_ms)
                );
            }
        }
    }
    if let Some((killed, bare2)) = &killed {
        println!();
        println!("Failover (D = 0)");
        println!(
            "| phase | leases/s | members' CPU / lease | ÷ bare pair | etcd calls / lease | bytes / lease (up + down) | acquire p50 / p99 | hand-off p50 / p99 | hand-off in RTT p50 / p99 | clients' CPU / lease | failed | keys left |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
        bare2.row(None, Duration::ZERO);
        killed.row(Some(bare2), Duration::ZERO);
        if let (Some(after), Some(r0)) = (
            killed.after_kill,
            results.iter().find(|r| r.delay.is_zero()),
        ) {
            let ratio = (after / bare2.rate) / (r0.leases.rate / r0.bare.rate);
            println!(
                "after the kill {after:.0} leases/s against the survivors' {:.0} bare pairs/s: {:.3}×, {ratio:.2}× the ratio without a kill",
                bare2.rate,
                after / bare2.rate,
            );
        }
    }
    println!();
    // A FIFO semaphore whose freed slot reaches the next waiter in one round trip serves at
    // most `slots / (mean hold + 1 RTT)` leases/s (holds are 1-5 ms: 3 ms on average).
    for r in &results {
        let d = r.delay.as_millis();
        let rtt_ms = 2.0 * d as f64;
        let per = |f: &Figures, x: f64| x / f.n.max(1) as f64;
        let (events, proposals) = (
            per(&r.leases, r.leases.counters.events),
            per(&r.leases, r.leases.counters.proposals),
        );
        println!(
            "per lease at D = {d} ms ({} processes on {} slots, through a supervisor): {events:.2} watch events (≤ 3: {}), {proposals:.2} raft proposals (≤ 2: {}), {:.2} etcd calls",
            plan.processes,
            plan.slots,
            verdict(events <= 3.0),
            verdict(proposals <= 2.0),
            r.leases.calls(),
        );
        println!(
            "one slot at D = {d} ms: {:.2}× the v3 Lock service (≥ 1.0×: {})",
            r.one_slot.rate / r.lock.rate,
            verdict(r.one_slot.rate >= r.lock.rate),
        );
        if d == 0 {
            let ratio = r.leases.members_cpu_ms / r.bare.members_cpu_ms;
            println!(
                "members' CPU per lease at D = 0: {ratio:.2}× a bare pair (≤ 2.5×: {})",
                verdict(ratio <= 2.5)
            );
            if let (Some(lease), Some(pair)) = (&r.leases.split, &r.bare.split) {
                println!(
                    "  where, per lease: {}\n  and per bare pair: {}",
                    lease.line(r.leases.members_cpu_ms),
                    pair.line(r.bare.members_cpu_ms)
                );
            }
        } else if !r.leases.hand_off.is_empty() {
            let bound = plan.slots as f64 / ((3.0 + rtt_ms) / 1e3);
            let (p50, p99) = (
                quantile_ms(&r.leases.hand_off, 0.5) / rtt_ms,
                quantile_ms(&r.leases.hand_off, 0.99) / rtt_ms,
            );
            println!(
                "at D = {d} ms: {:.0} leases/s against the hand-off bound {} / (3 ms + {rtt_ms:.0} ms) = {bound:.0}: {:.2}× (≥ 0.8×: {}); hand-off p50 {p50:.2} / p99 {p99:.2} round trips (≤ 1.2 / ≤ 2: {})",
                r.leases.rate,
                plan.slots,
                r.leases.rate / bound,
                verdict(r.leases.rate >= 0.8 * bound),
                verdict(p50 <= 1.2 && p99 <= 2.0),
            );
        }
    }
    let failed: usize = results
        .iter()
        .flat_map(|r| [&r.leases, &r.broker, &r.one_slot, &r.one_broker, &r.lock])
        .chain(killed.as_ref().map(|(k, _)| k))
        .map(|f| f.failed)
        .sum();
    let left: i64 = results
        .iter()
        .flat_map(|r| [&r.leases, &r.broker, &r.one_slot, &r.one_broker])
        .chain(killed.as_ref().map(|(k, _)| k))
        .filter_map(|f| f.left)
        .sum();
    assert!(
        failed == 0 || !test_mode,
        "{failed} leases failed in the smoke run"
    );
    assert!(
        left == 0,
        "{left} keys were left under the pools after every process shut down"
    );
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "missed" }
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

/// A serializable read's round trip through the proxy at `endpoint`, p50 of 20, in ms.
fn call_round_trip(rt: &tokio::runtime::Runtime, endpoint: &str) -> f64 {
    rt.block_on(async {
        let mut c = etcd_client::Client::connect([endpoint], None)
            .await
            .expect("connect through the proxy");
        let mut took = Vec::new();
        for _ in 0..21 {
            let t = Instant::now();
            c.get("bench-ping", Some(GetOptions::new().with_serializable()))
                .await
                .expect("read through the proxy");
            took.push(t.elapsed());
        }
        took.sort_unstable();
        took[took.len() / 2].as_secs_f64() * 1e3
    })
}

/// CPU seconds of the client processes and of the etcd members so far.
fn cpu(procs: &[Proc], cluster: &Cluster) -> (f64, f64) {
    let clients: Vec<u32> = procs.iter().map(|p| p.child.id()).collect();
    let members: Vec<u32> = (0..3).filter_map(|i| cluster.pid(i)).collect();
    (cpu_seconds(&clients), cpu_seconds(&members))
}

#[allow(clippy::too_many_arguments)]
fn bare(
    procs: &mut [Proc],
    cluster: &Cluster,
    net: &Net,
    members: &[usize],
    plan: &Plan,
    label: &str,
    profile: bool,
    work: &tempfile::TempDir,
) -> Figures {
    let joined = net.endpoints(members);
    for p in procs.iter_mut() {
        p.send(&format!("bare {joined} {}", plan.bare_for.as_millis()));
    }
    for p in procs.iter_mut() {
        p.expect("READY");
    }
    let c0 = Counters::read(cluster, members);
    let cpu0 = cpu(procs, cluster);
    let b0 = net.bytes();
    for p in procs.iter_mut() {
        p.send("go");
    }
    let profiles = profile.then(|| {
        let name = format!("bare-{}-{}", net.delay.as_millis(), members.len());
        // The loop's own length: the profile ends with it.
        let seconds = plan
            .bare_for
            .as_secs()
            .max(1)
            .min(plan.profile_seconds.max(1));
        profile_members(cluster, members, &name, seconds, plan, work)
    });
    let mut pairs = 0u64;
    for p in procs.iter_mut() {
        let line = p.expect("BARE");
        pairs += line.split(' ').nth(1).unwrap().parse::<u64>().unwrap();
    }
    let split = profiles.and_then(Profiles::split);
    let b1 = net.bytes();
    let cpu1 = cpu(procs, cluster);
    let counters = c0.since(&Counters::read(cluster, members));
    let n = pairs.max(1) as f64;
    Figures {
        label: label.to_owned(),
        n: pairs as usize,
        rate: pairs as f64 / plan.bare_for.as_secs_f64(),
        members_cpu_ms: (cpu1.1 - cpu0.1) * 1e3 / n,
        clients_cpu_ms: (cpu1.0 - cpu0.0) * 1e3 / n,
        counters,
        bytes: ((b1.0 - b0.0) as f64 / n, (b1.1 - b0.1) as f64 / n),
        acquire: Vec::new(),
        hand_off: Vec::new(),
        failed: 0,
        left: None,
        after_kill: None,
        split,
    }
}

/// One lease phase.
struct Phase {
    /// `leases` (jobs through a supervisor), `broker` (the broker driven directly) or `lock`
    /// (etcd's v3 Lock service).
    mode: String,
    pool: String,
    slots: u32,
    jobs: usize,
    label: String,
    /// The member to SIGKILL once a third of the jobs are done.
    kill: Option<usize>,
    /// Its members' CPU is split by request type (see `profile_members`).
    profile: bool,
}

fn phase(
    procs: &mut [Proc],
    cluster: &mut Cluster,
    net: &Net,
    rt: &tokio::runtime::Runtime,
    work: &tempfile::TempDir,
    plan: &Plan,
    phase: &Phase,
) -> Figures {
    let dir = work.path().join(&phase.pool);
    std::fs::create_dir_all(&dir).unwrap();
    let members = [0, 1, 2];
    let joined = net.endpoints(&members);
    for (i, p) in procs.iter_mut().enumerate() {
        p.send(&format!(
            "{} {joined} {} {} {} {}",
            phase.mode,
            phase.pool,
            phase.slots,
            phase.jobs,
            dir.join(format!("p{i}")).display()
        ));
    }
    for p in procs.iter_mut() {
        p.expect("READY");
    }
    let c0 = Counters::read(cluster, &members);
    let cpu0 = cpu(procs, cluster);
    let b0 = net.bytes();
    let started = Instant::now();
    for p in procs.iter_mut() {
        p.send("go");
    }
    let profiles = phase.profile.then(|| {
        profile_members(
            cluster,
            &members,
            &phase.pool,
            plan.profile_seconds,
            plan,
            work,
        )
    });
    let total = procs.len() * phase.jobs;
    let mut before_kill = Counters::default();
    let mut victim_cpu = 0.0;
    let mut killed_at = None;
    if let Some(victim) = phase.kill {
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
        before_kill = Counters::read(cluster, &[victim]);
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
    let split = profiles.and_then(Profiles::split);
    let b1 = net.bytes();
    let cpu1 = cpu(procs, cluster);
    let alive: Vec<usize> = members
        .iter()
        .copied()
        .filter(|i| Some(*i) != phase.kill)
        .collect();
    // The victim's counts as it died stand in for its counts at the end.
    let mut c1 = Counters::read(cluster, &alive);
    c1.add(&before_kill);
    let counters = c0.since(&c1);
    let holds: Vec<Hold> = read_holds(&dir);
    let n = holds.len().max(1) as f64;
    let after_kill = killed_at.map(|(at_ns, at)| {
        let after = holds.iter().filter(|h| h.end > at_ns).count();
        after as f64 / (started + wall - at).as_secs_f64()
    });
    let left = (phase.mode != "lock").then(|| keys_left(rt, cluster, &alive, &phase.pool));
    Figures {
        label: phase.label.clone(),
        n: holds.len(),
        rate: holds.len() as f64 / wall.as_secs_f64(),
        members_cpu_ms: (cpu1.1 + victim_cpu - cpu0.1) * 1e3 / n,
        clients_cpu_ms: (cpu1.0 - cpu0.0) * 1e3 / n,
        counters,
        bytes: ((b1.0 - b0.0) as f64 / n, (b1.1 - b0.1) as f64 / n),
        acquire: acquire_latencies(&holds),
        hand_off: hand_offs(&holds),
        failed,
        left,
        after_kill,
        split,
    }
}

/// A CPU profile of each of the members `members` over the next `seconds` (their pprof
/// endpoint: the cluster serves it), written to `{dir}/{name}-m{i}.pb.gz`: the dir of
/// `LEASEHOLD_SCALE_PPROF` (kept, for `go tool pprof`), else the bench's scratch dir.
fn profile_members(
    cluster: &Cluster,
    members: &[usize],
    name: &str,
    seconds: u64,
    plan: &Plan,
    work: &tempfile::TempDir,
) -> Profiles {
    let dir = plan
        .profile_dir
        .clone()
        .unwrap_or_else(|| work.path().join("pprof"));
    let _ = std::fs::create_dir_all(&dir);
    let (threads, files) = members
        .iter()
        .filter(|_| seconds > 0)
        .map(|&i| {
            let port = cluster.client_port(i);
            let file = dir.join(format!("{name}-m{i}.pb.gz"));
            let to = file.clone();
            let thread = std::thread::spawn(move || {
                use std::io::Read;
                let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
                    return;
                };
                let _ = write!(
                    s,
                    "GET /debug/pprof/profile?seconds={seconds} HTTP/1.0\r\nHost: x\r\n\r\n"
                );
                let mut body = Vec::new();
                let _ = s.read_to_end(&mut body);
                if let Some(at) = body.windows(4).position(|w| w == b"\r\n\r\n") {
                    let _ = std::fs::write(to, &body[at + 4..]);
                }
            });
            (thread, file)
        })
        .unzip();
    Profiles { threads, files }
}

/// Profiles being taken.
struct Profiles {
    threads: Vec<std::thread::JoinHandle<()>>,
    files: Vec<PathBuf>,
}

impl Profiles {
    /// Waits for them, and splits the CPU they sampled by request type.
    fn split(self) -> Option<pprof::Split> {
        for t in self.threads {
            let _ = t.join();
        }
        pprof::Split::read(&self.files)
    }
}

/// Keys under the pool `pool` besides its capacity record, read from a live member directly.
fn keys_left(rt: &tokio::runtime::Runtime, cluster: &Cluster, alive: &[usize], pool: &str) -> i64 {
    rt.block_on(async {
        let mut c = etcd_client::Client::connect([cluster.endpoint(alive[0])], None)
            .await
            .expect("connect to a live member");
        let prefix = format!("leasehold/{pool}/");
        let keys = c
            .get(
                prefix.clone(),
                Some(GetOptions::new().with_prefix().with_keys_only()),
            )
            .await
            .expect("read the pool");
        let mut left = 0;
        for kv in keys.kvs() {
            if kv.key() != format!("{prefix}capacity").as_bytes() {
                eprintln!("left under the pool: {}", String::from_utf8_lossy(kv.key()));
                left += 1;
            }
        }
        left
    })
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
                let broker = Arc::new(
                    rt.block_on(EtcdBroker::connect(config))
                        .expect("broker connects"),
                );
                say("READY".into());
                assert_eq!(commands.next().as_deref(), Some("go"));
                let jobs: usize = jobs.parse().unwrap();
                let (ok, failed) = rt.block_on(run_broker(
                    Arc::clone(&broker),
                    index,
                    jobs,
                    slots as usize,
                    Path::new(file),
                ));
                rt.block_on(leasehold::SlotBroker::close(&*broker))
                    .expect("close the broker");
                say(format!("LEASES {ok} {failed}"));
            }
            ["lock", endpoints, name, _slots, jobs, file] => {
                let endpoints: Vec<&str> = endpoints.split(',').collect();
                let client = rt
                    .block_on(etcd_client::Client::connect(&endpoints, None))
                    .expect("connect");
                say("READY".into());
                assert_eq!(commands.next().as_deref(), Some("go"));
                let jobs: usize = jobs.parse().unwrap();
                let (ok, failed) =
                    rt.block_on(run_locks(client, name, index, jobs, Path::new(file)));
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

/// The hold of lease `j` of a process whose generator is `seed`: 1–5 ms.
fn next_hold(seed: &mut u64) -> Duration {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    Duration::from_micros(1_000 + *seed % 4_001)
}

fn holds_file(file: &Path) -> Arc<std::sync::Mutex<std::fs::File>> {
    Arc::new(std::sync::Mutex::new(
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(file)
            .expect("open the holds file"),
    ))
}

/// All `jobs` jobs at once, each holding its slot 1–5 ms; every hold goes to `file` as
/// `submit start end slot` (ns). Returns (succeeded, failed).
async fn run_jobs(sup: &Supervisor, index: u64, jobs: usize, file: &Path) -> (usize, usize) {
    let out = holds_file(file);
    let mut set = tokio::task::JoinSet::new();
    let mut seed = index.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for j in 0..jobs {
        let hold = next_hold(&mut seed);
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
/// release), recorded like `run_jobs` (the end is when release is called). Returns
/// (succeeded, failed).
async fn run_broker(
    broker: Arc<EtcdBroker>,
    index: u64,
    jobs: usize,
    tasks: usize,
    file: &Path,
) -> (usize, usize) {
    use leasehold::{AcquireRequest, SlotBroker};
    let out = holds_file(file);
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
                let hold = next_hold(&mut seed);
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
                        match broker.release(token).await {
                            Ok(()) => ok += 1,
                            Err(e) => {
                                eprintln!("release failed: {e}");
                                failed += 1;
                            }
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

/// `jobs` holds of etcd's v3 Lock `name`, one after another (`Lock` under this process's own
/// session lease, hold 1–5 ms, `Unlock`), recorded like `run_broker`. Returns (succeeded,
/// failed).
async fn run_locks(
    mut client: etcd_client::Client,
    name: &str,
    index: u64,
    jobs: usize,
    file: &Path,
) -> (usize, usize) {
    let out = holds_file(file);
    // Outlives the phase: no keep-alive needed; revoked at the end (and its key with it).
    let lease = client
        .lease_grant(120, None)
        .await
        .expect("grant a session lease")
        .id();
    let mut seed = (index * 1000).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let (mut ok, mut failed) = (0, 0);
    for _ in 0..jobs {
        let hold = next_hold(&mut seed);
        let submit = now_ns();
        match client
            .lock(name, Some(LockOptions::new().with_lease(lease)))
            .await
        {
            Ok(locked) => {
                let start = now_ns();
                tokio::time::sleep(hold).await;
                let end = now_ns();
                writeln!(out.lock().unwrap(), "{submit} {start} {end} 0").unwrap();
                if client.unlock(locked.key()).await.is_ok() {
                    ok += 1;
                } else {
                    failed += 1;
                }
            }
            Err(e) => {
                eprintln!("lock failed: {e}");
                failed += 1;
            }
        }
    }
    let _ = client.lease_revoke(lease).await;
    (ok, failed)
}
