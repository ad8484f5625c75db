//! Test support for the etcd integration tests: the throwaway etcd servers and clusters
//! (`server`, shared with the `distributed` example and the scale benchmark), a fault-injecting
//! TCP proxy (lost answers, black hole), an independent, cross-process record of slot occupancy
//! and a ledger of every hold.
//!
//! Everything here is built on std (threads, `std::net`, `std::process`) so it works from any
//! test, synchronous or inside any async runtime.
#![allow(dead_code, unreachable_pub)]

mod server;

pub use server::*;

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

// ---------------------------------------------------------------------------------------------
// Proxy
// ---------------------------------------------------------------------------------------------

const MODE_FORWARD: u8 = 0;
const MODE_DROP_RESPONSES: u8 = 1;
const MODE_BLACKHOLE: u8 = 2;

/// Which way a pump moves bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    ClientToServer,
    ServerToClient,
}

/// One proxied connection: clones of both sockets, so `heal`/drop can shut them down.
struct Conn {
    id: u64,
    generation: u64,
    client: TcpStream,
    server: TcpStream,
}

impl Conn {
    fn close(&self) {
        let _ = self.client.shutdown(Shutdown::Both);
        let _ = self.server.shutdown(Shutdown::Both);
    }
}

struct ProxyShared {
    target: SocketAddr,
    mode: AtomicU8,
    /// Bumped by `heal`; connections of earlier generations are closed and never forward again.
    generation: AtomicU64,
    shutdown: AtomicBool,
    accepted: AtomicUsize,
    next_id: AtomicU64,
    conns: Mutex<Vec<Conn>>,
}

impl ProxyShared {
    fn conns(&self) -> std::sync::MutexGuard<'_, Vec<Conn>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether bytes going `dir` are currently discarded.
    fn discards(&self, dir: Direction) -> bool {
        match self.mode.load(Ordering::SeqCst) {
            MODE_DROP_RESPONSES => dir == Direction::ServerToClient,
            MODE_BLACKHOLE => true,
            _ => false,
        }
    }
}

/// A TCP proxy on a free loopback port forwarding to a target, able to lose answers (server →
/// client bytes discarded), black-hole both directions, and heal (closing every connection that
/// existed, so clients reconnect). Built on std threads; works under any runtime.
pub struct Proxy {
    port: u16,
    shared: Arc<ProxyShared>,
    accept_thread: Option<JoinHandle<()>>,
}

impl Proxy {
    /// Starts a proxy forwarding to `127.0.0.1:target_port`.
    pub fn start(target_port: u16) -> Proxy {
        Proxy::start_to(SocketAddr::from(([127, 0, 0, 1], target_port)))
    }

    /// Starts a proxy forwarding to `target`.
    pub fn start_to(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy bind 127.0.0.1:0");
        let port = listener.local_addr().expect("proxy local addr").port();
        let shared = Arc::new(ProxyShared {
            target,
            mode: AtomicU8::new(MODE_FORWARD),
            generation: AtomicU64::new(0),
            shutdown: AtomicBool::new(false),
            accepted: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            conns: Mutex::new(Vec::new()),
        });
        let accept_shared = Arc::clone(&shared);
        let accept_thread = thread::Builder::new()
            .name(format!("proxy-accept-{port}"))
            .spawn(move || accept_loop(listener, accept_shared))
            .expect("spawn proxy accept thread");
        Proxy {
            port,
            shared,
            accept_thread: Some(accept_thread),
        }
    }

    /// The proxy's URL, `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The proxy's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// From now on, server → client bytes are read and discarded on every connection (existing and
    /// new) while client → server bytes still pass: the server executes requests, the client never
    /// hears the answers.
    pub fn drop_responses(&self) {
        self.shared
            .mode
            .store(MODE_DROP_RESPONSES, Ordering::SeqCst);
    }

    /// From now on, bytes are discarded in both directions on every connection until `heal`.
    pub fn blackhole(&self) {
        self.shared.mode.store(MODE_BLACKHOLE, Ordering::SeqCst);
    }

    /// Stops discarding and closes every existing connection (both sockets), so clients reconnect
    /// on fresh connections; new connections forward both ways.
    pub fn heal(&self) {
        let mut conns = self.shared.conns();
        // Bump the generation before switching the mode back: a pump that sees the new mode also
        // sees the new generation and closes instead of resuming a half-dropped stream.
        let current = self.shared.generation.fetch_add(1, Ordering::SeqCst) + 1;
        self.shared.mode.store(MODE_FORWARD, Ordering::SeqCst);
        conns.retain(|conn| {
            if conn.generation < current {
                conn.close();
                false
            } else {
                true
            }
        });
    }

    /// How many client connections the proxy has accepted so far.
    pub fn connections_accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// How many proxied connections are open now.
    pub fn open_connections(&self) -> usize {
        self.shared.conns().len()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        // Unblock the accept call.
        let _ = TcpStream::connect_timeout(
            &SocketAddr::from(([127, 0, 0, 1], self.port)),
            Duration::from_secs(1),
        );
        if let Some(handle) = self.accept_thread.take() {
            let _ = handle.join();
        }
        for conn in self.shared.conns().drain(..) {
            conn.close();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<ProxyShared>) {
    loop {
        let accepted = listener.accept();
        if shared.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let client = match accepted {
            Ok((client, _)) => client,
            Err(_) => {
                // E.g. EMFILE or ECONNABORTED: back off briefly instead of spinning.
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        let server = match TcpStream::connect_timeout(&shared.target, Duration::from_secs(2)) {
            Ok(server) => server,
            Err(_) => {
                let _ = client.shutdown(Shutdown::Both);
                continue;
            }
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let clones = (
            client.try_clone(),
            server.try_clone(),
            client.try_clone(),
            server.try_clone(),
        );
        let (Ok(client_keep), Ok(server_keep), Ok(client_pump), Ok(server_pump)) = clones else {
            let _ = client.shutdown(Shutdown::Both);
            let _ = server.shutdown(Shutdown::Both);
            continue;
        };
        let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
        // Register under the lock that `heal` holds, so a connection is either closed by a heal or
        // belongs to the generation after it.
        let generation = {
            let mut conns = shared.conns();
            let generation = shared.generation.load(Ordering::SeqCst);
            conns.push(Conn {
                id,
                generation,
                client: client_keep,
                server: server_keep,
            });
            generation
        };
        let live = Arc::new(AtomicUsize::new(2));
        for (dir, src, dst) in [
            (Direction::ClientToServer, client, server),
            (Direction::ServerToClient, server_pump, client_pump),
        ] {
            let pump_shared = Arc::clone(&shared);
            let live = Arc::clone(&live);
            let spawned = thread::Builder::new()
                .name(format!("proxy-pump-{id}"))
                .spawn(move || {
                    pump(&pump_shared, dir, generation, src, dst);
                    if live.fetch_sub(1, Ordering::SeqCst) == 1 {
                        pump_shared.conns().retain(|conn| conn.id != id);
                    }
                });
            if spawned.is_err() {
                let mut conns = shared.conns();
                if let Some(conn) = conns.iter().find(|conn| conn.id == id) {
                    conn.close();
                }
                conns.retain(|conn| conn.id != id);
            }
        }
    }
}

/// Moves bytes from `src` to `dst` until EOF or an error, honouring the proxy's mode per chunk.
fn pump(
    shared: &ProxyShared,
    dir: Direction,
    generation: u64,
    mut src: TcpStream,
    mut dst: TcpStream,
) {
    let close_both = |src: &TcpStream, dst: &TcpStream| {
        let _ = src.shutdown(Shutdown::Both);
        let _ = dst.shutdown(Shutdown::Both);
    };
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let read = src.read(&mut buf);
        // Mode first, then generation (see `Proxy::heal`).
        let discard = shared.discards(dir);
        if shared.generation.load(Ordering::SeqCst) != generation {
            // Healed since this connection was accepted: it may be half-dropped, never resume it.
            close_both(&src, &dst);
            return;
        }
        match read {
            Ok(0) => {
                // A discarded direction loses its FIN too: the peer hears nothing at all.
                if !discard {
                    let _ = dst.shutdown(Shutdown::Write);
                }
                return;
            }
            Ok(n) => {
                if discard {
                    continue;
                }
                if dst.write_all(&buf[..n]).is_err() {
                    close_both(&src, &dst);
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => {
                if !discard {
                    close_both(&src, &dst);
                }
                return;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// OccupancyRecord
// ---------------------------------------------------------------------------------------------

/// An independent, cross-process record of how many jobs hold a slot at once, kept in a
/// directory: a file per current holder in `holders/`, and per-process append-only logs
/// `log-{pid}` of `enter {who} {ns} {count}` / `leave {who} {ns}` lines (ns since the UNIX epoch,
/// a clock shared by all processes on the host).
pub struct OccupancyRecord {
    dir: PathBuf,
}

impl OccupancyRecord {
    /// A record kept in `dir` (created if missing; may be shared with other processes).
    pub fn at(dir: &Path) -> OccupancyRecord {
        fs::create_dir_all(dir.join("holders"))
            .unwrap_or_else(|e| panic!("create {}/holders: {e}", dir.display()));
        OccupancyRecord {
            dir: dir.to_path_buf(),
        }
    }

    /// The record's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Records that `who` now holds a slot and returns how many hold one (including `who`) as
    /// counted right after; panics if `who` already holds one. Call it once the slot is held.
    pub fn enter(&self, who: &str) -> usize {
        check_name(who);
        let holder = self.dir.join("holders").join(who);
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&holder)
        {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                panic!(
                    "job {who} entered twice (holder file {} exists)",
                    holder.display()
                )
            }
            Err(e) => panic!("create holder file {}: {e}", holder.display()),
        }
        let count = holders_in(&self.dir);
        let ns = now_ns();
        self.append(&format!("enter {who} {ns} {count}\n"));
        count
    }

    /// Records that `who` no longer holds a slot; call it before the slot is given back. Panics if
    /// `who` did not hold one.
    pub fn leave(&self, who: &str) {
        check_name(who);
        let ns = now_ns();
        self.append(&format!("leave {who} {ns}\n"));
        let holder = self.dir.join("holders").join(who);
        fs::remove_file(&holder).unwrap_or_else(|e| {
            panic!("job {who} left without holding ({}): {e}", holder.display())
        });
    }

    /// The largest holder count any `enter` saw, over every process's log in `dir`.
    pub fn max_seen(dir: &Path) -> usize {
        read_events(dir)
            .into_iter()
            .filter_map(|event| match event {
                Event::Enter { count, .. } => Some(count),
                Event::Leave { .. } => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// The largest number of simultaneous holders, from the enter/leave events of every process's
    /// log in `dir` merged by timestamp (a leave and an enter at the same instant do not overlap).
    pub fn max_overlap(dir: &Path) -> usize {
        let mut events: Vec<(u128, i64)> = read_events(dir)
            .into_iter()
            .map(|event| match event {
                Event::Enter { ns, .. } => (ns, 1),
                Event::Leave { ns } => (ns, -1),
            })
            .collect();
        // At equal timestamps, leaves (-1) sort before enters (+1).
        events.sort_unstable();
        let (mut now, mut max) = (0i64, 0i64);
        for (_, delta) in events {
            now += delta;
            max = max.max(now);
        }
        usize::try_from(max).unwrap_or(0)
    }

    /// How many hold a slot now (holder files present in `dir/holders`).
    pub fn holders_now(dir: &Path) -> usize {
        holders_in(dir)
    }

    fn append(&self, line: &str) {
        let path = self.dir.join(format!("log-{}", std::process::id()));
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        // One write of one short line with O_APPEND: lines of concurrent writers never interleave.
        file.write_all(line.as_bytes())
            .unwrap_or_else(|e| panic!("append to {}: {e}", path.display()));
    }
}

enum Event {
    Enter { ns: u128, count: usize },
    Leave { ns: u128 },
}

fn check_name(who: &str) {
    assert!(
        !who.is_empty() && !who.contains(['/', ' ', '\n', '\t', '\0']) && who != "." && who != "..",
        "holder name {who:?} must be a plain file name without whitespace"
    );
}

fn holders_in(dir: &Path) -> usize {
    match fs::read_dir(dir.join("holders")) {
        Ok(entries) => entries.filter(|entry| entry.is_ok()).count(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
        Err(e) => panic!("read {}/holders: {e}", dir.display()),
    }
}

fn read_events(dir: &Path) -> Vec<Event> {
    let mut events = Vec::new();
    let entries = fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
    for entry in entries {
        let entry = entry.unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
        if !entry.file_name().to_string_lossy().starts_with("log-") {
            continue;
        }
        let path = entry.path();
        let mut text = String::new();
        File::open(&path)
            .and_then(|mut f| f.read_to_string(&mut text))
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        for line in text.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            let parse_ns = |s: &str| -> u128 {
                s.parse().unwrap_or_else(|e| {
                    panic!("bad timestamp in {}: {line:?}: {e}", path.display())
                })
            };
            match fields.as_slice() {
                ["enter", _, ns, count] => events.push(Event::Enter {
                    ns: parse_ns(ns),
                    count: count.parse().unwrap_or_else(|e| {
                        panic!("bad count in {}: {line:?}: {e}", path.display())
                    }),
                }),
                ["leave", _, ns] => events.push(Event::Leave { ns: parse_ns(ns) }),
                _ => panic!("malformed line in {}: {line:?}", path.display()),
            }
        }
    }
    events
}

/// The broker settings every etcd test uses: a short TTL (2 s, close to etcd's minimum) so
/// that lapses happen within a test, and short call bounds.
pub fn test_config(endpoint: &str, pool: &str, capacity: u32) -> leasehold_etcd::EtcdConfig {
    leasehold_etcd::EtcdConfig::new([endpoint], pool, capacity)
        .ttl(std::time::Duration::from_secs(2))
        .rpc_timeout(std::time::Duration::from_millis(500))
        .retry_for(std::time::Duration::from_secs(3))
}

/// Slot keys held right now in `pool` (default prefix), read straight from etcd: (key, lease).
pub async fn slot_keys(c: &mut etcd_client::Client, pool: &str) -> Vec<(String, i64)> {
    let resp = c
        .get(
            format!("leasehold/{pool}/slot/"),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    resp.kvs()
        .iter()
        .map(|kv| (kv.key_str().unwrap().to_owned(), kv.lease()))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Child processes (the test binary run again)
// ---------------------------------------------------------------------------------------------

/// A child process killed (and reaped) when the test ends, also when it fails.
pub struct ChildGuard(pub Child);

impl std::ops::Deref for ChildGuard {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for ChildGuard {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Runs this test binary again as a child: only the test `entry`, with `env=mode` and `vars`
/// set, its stdout piped (see [`lines_of`]).
pub fn spawn_test_child(entry: &str, env: &str, mode: &str, vars: &[(&str, String)]) -> ChildGuard {
    let child = Command::new(std::env::current_exe().unwrap())
        .args([entry, "--exact", "--nocapture", "--test-threads=1"])
        .env(env, mode)
        .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child test process");
    ChildGuard(child)
}

/// [`spawn_test_child`], with the child's stdin piped too: the test tells the child when to
/// go on by writing a line (see [`tell`]); the child reads it with [`wait_for_word`].
pub fn spawn_test_child_with_stdin(
    entry: &str,
    env: &str,
    mode: &str,
    vars: &[(&str, String)],
) -> ChildGuard {
    let child = Command::new(std::env::current_exe().unwrap())
        .args([entry, "--exact", "--nocapture", "--test-threads=1"])
        .env(env, mode)
        .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child test process");
    ChildGuard(child)
}

/// Writes `word` as a line to the child's stdin (see [`spawn_test_child_with_stdin`]).
pub fn tell(child: &mut Child, word: &str) {
    let stdin = child.stdin.as_mut().expect("the child's stdin is piped");
    writeln!(stdin, "{word}").expect("write to the child's stdin");
    stdin.flush().expect("flush the child's stdin");
}

/// In the child: blocks until the parent has written `word` on a line of stdin; panics if
/// stdin ends first.
pub fn wait_for_word(word: &str) {
    for line in io::stdin().lock().lines() {
        if line.expect("read stdin").trim() == word {
            return;
        }
    }
    panic!("stdin ended before {word:?}");
}

/// Reads the child's stdout on a thread; lines arrive on the channel.
pub fn lines_of(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The next line of the child's that contains `prefix`, from `prefix` on (libtest prints
/// "test NAME ... " before the child's first line); panics after 60 s without one.
pub fn next_line_with(rx: &std::sync::mpsc::Receiver<String>, prefix: &str) -> String {
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("no {prefix} line from the child: {e}"));
        if let Some(at) = line.find(prefix) {
            return line[at..].to_owned();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Ledger
// ---------------------------------------------------------------------------------------------

/// One hold, as the job that held the slot recorded it (nanoseconds since the UNIX epoch, a
/// clock shared by every process on the host).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    pub slot: u32,
    pub token: u64,
    pub start: u128,
    pub end: u128,
    pub who: String,
}

/// An independent, cross-process ledger of holds: jobs append `hold {slot} {token} {start}
/// {end} {who}` to `dir/ledger-{pid}` once they are done holding (their interval lies inside
/// the real hold: it starts after the grant and ends before the release).
pub struct Ledger {
    dir: PathBuf,
}

impl Ledger {
    /// A ledger kept in `dir` (created if missing; may be shared with other processes).
    pub fn at(dir: &Path) -> Ledger {
        fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        Ledger {
            dir: dir.to_path_buf(),
        }
    }

    /// Records one hold.
    pub fn record(&self, slot: u32, token: u64, start: u128, end: u128, who: &str) {
        check_name(who);
        let path = self.dir.join(format!("ledger-{}", std::process::id()));
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        // One short line per write with O_APPEND: lines of concurrent writers never interleave.
        file.write_all(format!("hold {slot} {token} {start} {end} {who}\n").as_bytes())
            .unwrap_or_else(|e| panic!("append to {}: {e}", path.display()));
    }

    /// Every hold recorded in `dir`, by every process.
    pub fn holds(dir: &Path) -> Vec<Hold> {
        let mut holds = Vec::new();
        let Ok(entries) = fs::read_dir(dir) else {
            return holds;
        };
        for entry in entries.flatten() {
            if !entry.file_name().to_string_lossy().starts_with("ledger-") {
                continue;
            }
            let text = fs::read_to_string(entry.path()).unwrap_or_default();
            for line in text.lines() {
                let f: Vec<&str> = line.split(' ').collect();
                let [_, slot, token, start, end, who] = f.as_slice() else {
                    panic!("malformed ledger line {line:?}");
                };
                holds.push(Hold {
                    slot: slot.parse().unwrap(),
                    token: token.parse().unwrap(),
                    start: start.parse().unwrap(),
                    end: end.parse().unwrap(),
                    who: (*who).to_owned(),
                });
            }
        }
        holds
    }

    /// How many holds are recorded in `dir`.
    pub fn count(dir: &Path) -> usize {
        Ledger::holds(dir).len()
    }

    /// Checks the ledger: per slot, in time order, hold intervals never overlap and tokens
    /// increase; no token serves two holds. Returns the number of holds.
    pub fn check(dir: &Path) -> Result<usize, String> {
        let holds = Ledger::holds(dir);
        let mut tokens = std::collections::HashSet::new();
        for h in &holds {
            if !tokens.insert(h.token) {
                return Err(format!("token {} served two holds ({})", h.token, h.who));
            }
        }
        let mut by_slot: std::collections::BTreeMap<u32, Vec<&Hold>> = Default::default();
        for h in &holds {
            by_slot.entry(h.slot).or_default().push(h);
        }
        for (slot, mut list) in by_slot {
            list.sort_by_key(|h| (h.start, h.end));
            for pair in list.windows(2) {
                let (a, b) = (pair[0], pair[1]);
                if b.start < a.end {
                    return Err(format!(
                        "slot {slot}: {} (token {}) and {} (token {}) overlap by {} ns",
                        a.who,
                        a.token,
                        b.who,
                        b.token,
                        a.end - b.start
                    ));
                }
                if b.token <= a.token {
                    return Err(format!(
                        "slot {slot}: token {} of {} after token {} of {}",
                        b.token, b.who, a.token, a.who
                    ));
                }
            }
        }
        Ok(holds.len())
    }
}

/// Nanoseconds since the UNIX epoch (the ledger's clock).
pub fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("system clock before 1970")
        .as_nanos()
}

// ---------------------------------------------------------------------------------------------
// Async helpers of the broker tests (on the test's tokio runtime)
// ---------------------------------------------------------------------------------------------

/// Polls `check` until it holds; fails the test after `within`.
pub async fn wait_until<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Keeps `token` alive as a supervisor does (a token nobody keeps alive is given back after a
/// TTL); abort the task before releasing it.
pub fn keep(
    broker: &Arc<leasehold_etcd::EtcdBroker>,
    token: leasehold::SlotToken,
) -> tokio::task::JoinHandle<()> {
    use leasehold::SlotBroker;
    let broker = Arc::clone(broker);
    tokio::spawn(async move {
        broker.keep_alive(token).await;
    })
}

/// A broker of pool `pool` (default prefix, [`test_config`]) on `etcd`.
pub async fn connect_pool(
    etcd: &Etcd,
    pool: &str,
    capacity: u32,
) -> Arc<leasehold_etcd::EtcdBroker> {
    Arc::new(
        leasehold_etcd::EtcdBroker::connect(test_config(&etcd.endpoint(), pool, capacity))
            .await
            .unwrap(),
    )
}

/// Waits until `broker`'s acquire of `request` waits in the queue: its queue key exists in
/// etcd (asked through `c`) under the broker's session. Returns the key.
pub async fn wait_queued(
    c: &etcd_client::Client,
    broker: &leasehold_etcd::EtcdBroker,
    request: &leasehold::AcquireRequest,
) -> String {
    let mut c = c.clone();
    let found = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let (Some(key), Some(session)) =
                (broker.queue_key_for(request), broker.session_lease())
            {
                let got = c.get(key.as_str(), None).await.unwrap();
                if got.kvs().first().is_some_and(|kv| kv.lease() == session) {
                    return key;
                }
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    found.unwrap_or_else(|_| panic!("request {} never queued", request.request_id()))
}
