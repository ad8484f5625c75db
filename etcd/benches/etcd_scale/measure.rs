//! What the bench reads off the cluster over a phase: the members' CPU (`/proc/<pid>/stat`),
//! their gRPC calls by method and the watch events they sent (`/metrics`); and what it makes of
//! the holds the client processes recorded (acquire latency, hand-off time).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::etcd_server::{Cluster, metric_sum};

/// CPU seconds (user + system) used so far by the processes `pids`, from `/proc`.
pub fn cpu_seconds(pids: &[u32]) -> f64 {
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

/// What the members' `/metrics` say, summed over the members read.
#[derive(Debug, Clone, Default)]
pub struct Counters {
    /// gRPC calls (unary calls and streams) started, by method.
    pub calls: BTreeMap<String, f64>,
    /// gRPC messages received, by method (a stream's messages: watch requests, keep-alives).
    pub received: BTreeMap<String, f64>,
    /// Watch events sent to clients.
    pub events: f64,
    /// Raft proposals committed (the most any member counts).
    pub proposals: f64,
}

impl Counters {
    /// Reads the members `members` of `cluster` (those that do not answer are left out).
    pub fn read(cluster: &Cluster, members: &[usize]) -> Counters {
        let mut c = Counters::default();
        for m in members.iter().filter_map(|i| cluster.metrics(*i).ok()) {
            for (name, into) in [
                ("grpc_server_started_total", &mut c.calls),
                ("grpc_server_msg_received_total", &mut c.received),
            ] {
                for line in m.lines().filter(|l| l.starts_with(name)) {
                    let (Some(method), Some(v)) = (
                        line.split("grpc_method=\"")
                            .nth(1)
                            .and_then(|r| r.split('"').next()),
                        line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()),
                    ) else {
                        continue;
                    };
                    *into.entry(method.to_owned()).or_default() += v;
                }
            }
            c.events += metric_sum(&m, "etcd_debugging_mvcc_events_total");
            c.proposals = c
                .proposals
                .max(metric_sum(&m, "etcd_server_proposals_committed_total"));
        }
        c
    }

    /// What happened between `self` (earlier) and `later`.
    pub fn since(&self, later: &Counters) -> Counters {
        let diff = |a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>| {
            b.iter()
                .map(|(k, v)| (k.clone(), v - a.get(k).copied().unwrap_or(0.0)))
                .filter(|(_, v)| *v > 0.0)
                .collect()
        };
        Counters {
            calls: diff(&self.calls, &later.calls),
            received: diff(&self.received, &later.received),
            events: later.events - self.events,
            proposals: later.proposals - self.proposals,
        }
    }

    /// Adds what `other` counted (a member read before it was killed).
    pub fn add(&mut self, other: &Counters) {
        for (k, v) in &other.calls {
            *self.calls.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.received {
            *self.received.entry(k.clone()).or_default() += v;
        }
        self.events += other.events;
    }

    pub fn total_calls(&self) -> f64 {
        self.calls.values().sum()
    }

    /// Per lease (or pair), by method: `Txn 1.02, Range 1.00, …`, then the stream messages and
    /// the watch events.
    pub fn profile(&self, n: f64) -> String {
        let calls: Vec<String> = self
            .calls
            .iter()
            .map(|(k, v)| format!("{k} {:.2}", v / n))
            .collect();
        let streams: Vec<String> = ["Watch", "LeaseKeepAlive"]
            .iter()
            .filter_map(|k| Some(format!("{k} {:.2}", self.received.get(*k)? / n)))
            .collect();
        format!(
            "calls: {}; stream messages received: {}; watch events sent {:.2}; raft proposals {:.2}",
            calls.join(", "),
            if streams.is_empty() {
                "none".into()
            } else {
                streams.join(", ")
            },
            self.events / n,
            self.proposals / n
        )
    }
}

/// One hold as a client process recorded it, in ns since the epoch: `submit` (the acquire was
/// asked for), `start` (granted), `end` (the holder let go: its body ended, or it called
/// release), `slot`.
#[derive(Debug, Clone, Copy)]
pub struct Hold {
    pub submit: u128,
    pub start: u128,
    pub end: u128,
    pub slot: u128,
}

/// Every hold recorded under `dir` (one file per process, one line per hold).
pub fn read_holds(dir: &Path) -> Vec<Hold> {
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

/// The `q` quantile of sorted `values` (ns), in ms.
pub fn quantile_ms(sorted: &[u128], q: f64) -> f64 {
    sorted
        .get(((sorted.len() as f64 - 1.0) * q).round() as usize)
        .copied()
        .unwrap_or(0) as f64
        / 1e6
}

/// The acquire latencies (submit to grant), sorted.
pub fn acquire_latencies(holds: &[Hold]) -> Vec<u128> {
    let mut v: Vec<u128> = holds
        .iter()
        .map(|h| h.start.saturating_sub(h.submit))
        .collect();
    v.sort_unstable();
    v
}

/// The hand-offs, sorted: on each slot, from one holder's end to the next holder's grant,
/// counted only where the next holder was already waiting when the first let go (otherwise the
/// gap is nobody asking, not a hand-off).
pub fn hand_offs(holds: &[Hold]) -> Vec<u128> {
    let mut by_slot: HashMap<u128, Vec<Hold>> = HashMap::new();
    for h in holds {
        by_slot.entry(h.slot).or_default().push(*h);
    }
    let mut gaps: Vec<u128> = by_slot
        .values_mut()
        .flat_map(|v| {
            v.sort_unstable_by_key(|h| h.start);
            v.windows(2)
                .filter(|w| w[1].submit <= w[0].end)
                .map(|w| w[1].start.saturating_sub(w[0].end))
                .collect::<Vec<_>>()
        })
        .collect();
    gaps.sort_unstable();
    gaps
}
