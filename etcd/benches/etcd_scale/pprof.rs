//! Where the etcd members spend their CPU: a member's CPU profile (Go's pprof, from
//! `/debug/pprof/profile` of a member started with `--enable-pprof`), each sample put under the
//! request type it served, read off its stack.
//!
//! The profile is a gzipped protocol buffer (`profile.proto` of github.com/google/pprof),
//! unzipped by `gzip -dc`; this reads the few fields it needs by hand: the samples (their stacks as location ids, and their
//! CPU nanoseconds), the locations (their function ids), the functions (their names) and the
//! string table.

use std::collections::HashMap;

/// What a sample's stack says it served, checked in order: the first kind any frame of the
/// stack matches. Watch work first (a watch's events are sent from the apply of the write that
/// made them), then the apply of each request type, then each request's gRPC path, then what
/// no request owns.
const KINDS: &[(&str, &[&str])] = &[
    (
        "watch",
        &[
            "watchableStore",
            "serverWatchStream",
            "(*watchStream)",
            "_Watch_Watch_Handler",
            "(*watcherGroup)",
        ],
    ),
    (
        "apply txn: reads",
        &["applierV3backend).Range", "rangeKeys"],
    ),
    ("apply txn: compares", &["applyCompare"]),
    (
        "apply txn: writes",
        &[
            "applierV3backend).Txn",
            "applierV3backend).Put",
            "applierV3backend).DeleteRange",
        ],
    ),
    (
        "leases",
        &[
            "applierV3backend).Lease",
            "_Lease_",
            "lessor",
            "(*EtcdServer).LeaseRenew",
            "(*LeaseServer)",
        ],
    ),
    (
        "apply other",
        &[
            "applyEntryNormal",
            "applierV3backend",
            "(*EtcdServer).apply",
        ],
    ),
    ("Txn RPC path", &["_KV_Txn_Handler", "(*EtcdServer).Txn"]),
    (
        "Range RPC path",
        &["_KV_Range_Handler", "(*EtcdServer).Range"],
    ),
    (
        "other RPCs",
        &["_KV_", "_Maintenance_", "_Cluster_", "_Auth_"],
    ),
    (
        "backend commit (bbolt)",
        &[
            "backend.(*backend)",
            "(*batchTx",
            "go.etcd.io/bbolt",
            "(*readTx)",
        ],
    ),
    (
        "raft, WAL, peers",
        &["etcd/raft", "raftNode", "etcd/wal", "rafthttp", "(*raft)"],
    ),
    (
        "gRPC / HTTP/2 transport",
        &[
            "google.golang.org/grpc",
            "golang.org/x/net/http2",
            "net/http",
        ],
    ),
    (
        "Go GC",
        &[
            "runtime.gcBgMarkWorker",
            "runtime.gcDrain",
            "runtime.bgsweep",
            "runtime.bgscavenge",
            "runtime.gcAssist",
        ],
    ),
    ("Go runtime other", &["runtime."]),
];

/// CPU nanoseconds by kind (in [`KINDS`] order, then `other`), summed over profiles.
#[derive(Debug, Clone, Default)]
pub struct Split {
    pub nanos: Vec<(String, u64)>,
}

impl Split {
    /// Reads the gzipped profiles `files` (those missing or unreadable are left out); `None`
    /// when none could be read.
    pub fn read(files: &[std::path::PathBuf]) -> Option<Split> {
        let mut by: HashMap<&'static str, u64> = HashMap::new();
        let mut read = 0;
        for file in files {
            // gzip, which every Debian has (essential), rather than a crate for one bench.
            let Ok(out) = std::process::Command::new("gzip")
                .arg("-dc")
                .arg(file)
                .output()
            else {
                continue;
            };
            if !out.status.success() {
                continue;
            }
            let raw = out.stdout;
            let Some(profile) = Profile::decode(&raw) else {
                continue;
            };
            read += 1;
            for (stack, nanos) in profile.samples() {
                *by.entry(kind_of(&stack)).or_default() += nanos;
            }
        }
        (read > 0).then(|| Split {
            nanos: KINDS
                .iter()
                .map(|(k, _)| *k)
                .chain(["other"])
                .map(|k| (k.to_owned(), by.get(k).copied().unwrap_or(0)))
                .collect(),
        })
    }

    pub fn total(&self) -> u64 {
        self.nanos.iter().map(|(_, n)| n).sum()
    }

    /// `kind share% (ms per lease)` for each kind with any samples, largest first, given the
    /// members' CPU per lease it splits.
    pub fn line(&self, per_lease_ms: f64) -> String {
        let total = self.total().max(1) as f64;
        let mut kinds: Vec<&(String, u64)> = self.nanos.iter().filter(|(_, n)| *n > 0).collect();
        kinds.sort_by_key(|k| std::cmp::Reverse(k.1));
        kinds
            .iter()
            .map(|(k, n)| {
                let share = *n as f64 / total;
                format!("{k} {:.0}% ({:.2} ms)", share * 100.0, share * per_lease_ms)
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn kind_of(stack: &[&str]) -> &'static str {
    for (kind, patterns) in KINDS {
        if stack
            .iter()
            .any(|frame| patterns.iter().any(|p| frame.contains(p)))
        {
            return kind;
        }
    }
    "other"
}

/// The parts of a pprof profile this reads.
#[derive(Default)]
struct Profile {
    /// (location ids leaf first, values)
    samples: Vec<(Vec<u64>, Vec<i64>)>,
    /// location id → function ids (inlined frames first)
    locations: HashMap<u64, Vec<u64>>,
    /// function id → name (string table index)
    functions: HashMap<u64, i64>,
    strings: Vec<String>,
    /// Which value is CPU time: the sample type whose unit is nanoseconds.
    sample_types: Vec<(i64, i64)>,
}

impl Profile {
    fn decode(buf: &[u8]) -> Option<Profile> {
        let mut p = Profile::default();
        for (field, value) in Fields::new(buf) {
            match (field, value?) {
                (1, Value::Bytes(b)) => {
                    let mut t = (0, 0);
                    for (f, v) in Fields::new(b) {
                        match (f, v?) {
                            (1, Value::Varint(x)) => t.0 = x as i64,
                            (2, Value::Varint(x)) => t.1 = x as i64,
                            _ => {}
                        }
                    }
                    p.sample_types.push(t);
                }
                (2, Value::Bytes(b)) => {
                    let (mut locations, mut values) = (Vec::new(), Vec::new());
                    for (f, v) in Fields::new(b) {
                        match (f, v?) {
                            (1, v) => locations.extend(v.varints()?),
                            (2, v) => values.extend(v.varints()?.into_iter().map(|x| x as i64)),
                            _ => {}
                        }
                    }
                    p.samples.push((locations, values));
                }
                (4, Value::Bytes(b)) => {
                    let (mut id, mut functions) = (0, Vec::new());
                    for (f, v) in Fields::new(b) {
                        match (f, v?) {
                            (1, Value::Varint(x)) => id = x,
                            (4, Value::Bytes(line)) => {
                                for (lf, lv) in Fields::new(line) {
                                    if let (1, Value::Varint(x)) = (lf, lv?) {
                                        functions.push(x);
                                    }
                                }
                            }
                            _ => {}
                        }
                    }
                    p.locations.insert(id, functions);
                }
                (5, Value::Bytes(b)) => {
                    let (mut id, mut name) = (0, 0);
                    for (f, v) in Fields::new(b) {
                        match (f, v?) {
                            (1, Value::Varint(x)) => id = x,
                            (2, Value::Varint(x)) => name = x as i64,
                            _ => {}
                        }
                    }
                    p.functions.insert(id, name);
                }
                (6, Value::Bytes(b)) => p.strings.push(String::from_utf8_lossy(b).into_owned()),
                _ => {}
            }
        }
        Some(p)
    }

    /// Each sample's stack (function names) and CPU nanoseconds.
    fn samples(&self) -> impl Iterator<Item = (Vec<&str>, u64)> + '_ {
        let string = |i: i64| self.strings.get(i as usize).map_or("", String::as_str);
        let cpu = self
            .sample_types
            .iter()
            .position(|(_, unit)| string(*unit) == "nanoseconds")
            .unwrap_or(self.sample_types.len().saturating_sub(1));
        self.samples.iter().map(move |(locations, values)| {
            let stack = locations
                .iter()
                .flat_map(|l| self.locations.get(l).into_iter().flatten())
                .map(|f| self.functions.get(f).map_or("", |n| string(*n)))
                .collect();
            (stack, values.get(cpu).copied().unwrap_or(0).max(0) as u64)
        })
    }
}

/// A field's value on the wire.
enum Value<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

impl Value<'_> {
    /// A repeated integer field's values: one (unpacked) or many (packed).
    fn varints(self) -> Option<Vec<u64>> {
        match self {
            Value::Varint(x) => Some(vec![x]),
            Value::Bytes(mut b) => {
                let mut out = Vec::new();
                while !b.is_empty() {
                    out.push(varint(&mut b)?);
                }
                Some(out)
            }
            Value::Fixed => None,
        }
    }
}

/// The fields of one message, in order; a malformed one ends it with `None`.
struct Fields<'a> {
    buf: &'a [u8],
    broken: bool,
}

impl<'a> Fields<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Fields { buf, broken: false }
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = (u64, Option<Value<'a>>);

    fn next(&mut self) -> Option<Self::Item> {
        if self.buf.is_empty() || self.broken {
            return None;
        }
        let value = (|| {
            let key = varint(&mut self.buf)?;
            let value = match key & 7 {
                0 => Value::Varint(varint(&mut self.buf)?),
                1 => {
                    self.buf = self.buf.get(8..)?;
                    Value::Fixed
                }
                2 => {
                    let n = varint(&mut self.buf)? as usize;
                    let (bytes, rest) = (self.buf.get(..n)?, self.buf.get(n..)?);
                    self.buf = rest;
                    Value::Bytes(bytes)
                }
                5 => {
                    self.buf = self.buf.get(4..)?;
                    Value::Fixed
                }
                _ => return None,
            };
            Some((key >> 3, value))
        })();
        match value {
            Some((field, value)) => Some((field, Some(value))),
            None => {
                self.broken = true;
                Some((0, None))
            }
        }
    }
}

fn varint(buf: &mut &[u8]) -> Option<u64> {
    let mut x = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = buf.split_first()?;
        *buf = rest;
        x |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(x);
        }
    }
    None
}
