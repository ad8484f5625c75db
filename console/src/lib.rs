#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]
#![deny(unused_must_use)]
//! A live web console of a [leasehold](https://docs.rs/leasehold) supervisor: its slots, leases and their
//! release pipeline, quarantine, stats and the last outcomes, in a browser, updated ten times a
//! second; with optional, token-guarded actions (cancel a job, reclaim quarantined slots,
//! resize the pool).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use leasehold::Supervisor;
//! use leasehold_console::{ActionsToken, Console};
//!
//! let sup = Supervisor::builder().slots(4).start().await?;
//! let console = Console::builder(sup.clone())
//!     .actions(ActionsToken::random()?)   // leave out for a read-only console
//!     .start()
//!     .await?;
//! println!("console: {}", console.url()); // http://127.0.0.1:<port>/
//! # Ok(()) }
//! ```
//!
//! # What the page shows
//!
//! - **Lanes**: one per slot (every slot below the capacity, and any other slot held or seen
//!   in the last minute). A held slot shows its holder (the job id, or "explicit lease"), the
//!   lease's phase (`running`, `draining`, `releasing`, `quarantined`), how long it has been
//!   held, its priority, and what its release still waits for, in pipeline order (the worker,
//!   tracked tasks, a process group, GPU work, the temp dir, the broker). Colours are those of
//!   `render_farm`'s `timeline.png`: running steel blue, draining amber, draining while GPU
//!   work is owed dark orange, the broker release green; quarantined is red.
//! - **Timeline**: per slot, the last minute, in the same colours (its own route, refreshed
//!   about once a second).
//! - **Last five minutes**: per second, the throughput (the job ends the console saw), the
//!   queue's depth, the wait (p50 and p99, as the queue listing showed it) and the drain (p99,
//!   from the body's end to the release), drawn in the page (SVG) with a time axis (a minute
//!   while the console is younger than that), a y scale from 0 and a legend; "now" is the last
//!   second that has ended (the one in progress has not counted all its ends), and a value
//!   without a neighbour is a dot.
//! - **GPU devices** (with GPU slots): per device its adapter, sub-slots in use, leases
//!   waiting for its fence, and whether it is lost and how often it was re-created
//!   ([`Supervisor::gpu_devices`](leasehold::Supervisor::gpu_devices)).
//! - **Queue**: how many callers wait for a slot, the first of them in the order they are
//!   served (job, class, slots, wait: [`Supervisor::waiters`](leasehold::Supervisor::waiters)),
//!   and a search by job id over all of them. The listing is asked for about once a second, the
//!   lanes ten times a second: a job the lease table shows granted since the listing was asked
//!   for is left out, so the queue never lists a job that the same frame shows holding a slot.
//! - **Quarantine**: every quarantined slot with its job and the reason its physical end could
//!   not be proven.
//! - **Stats**: the [`Stats`](leasehold::Stats) counters.
//! - **History**: the last job ends ([`ConsoleBuilder::history`], default
//!   [`DEFAULT_HISTORY`]), newest first, 25 to a page, with a filter by code (or the embedder's
//!   label) and a search by job id: each with its stable code when the embedder reports results
//!   through [`Outcomes`] (its acquire, body and cleanup errors each on its own, one phrase
//!   each), and the embedder's own label and note when it gives them ([`JobNote`]: a frame
//!   rendered already shows as `SKIPPED`); otherwise as observed (the lease left the table),
//!   marked "code not reported". A row opens the job's detail in a dialog over the page: its
//!   slot and lease, how long it waited (as the queue listing showed), ran, drained (with the
//!   time of each proof: the worker, tracked tasks, GPU work, the temp dir) and took to
//!   release, as sampled. The page's height stays bounded whatever the history's size.
//! - **Actions** (when turned on): the token field, cancel by job id (also a button on each
//!   job's lane), reclaim quarantined slots (next to the quarantine), resize. Each names what
//!   it acts on and asks to confirm: the first click arms the button with the question (the
//!   job and its lease, the quarantined slots, the capacity from and to), the second sends
//!   exactly that; an armed button whose target changes (its lane passed to another job)
//!   disarms, and the server refuses an action whose target has changed since
//!   (`CONSOLE_TARGET_CHANGED`). Each answer shows next to its button, with its status and
//!   code; a cancel says "requested" until the job's end arrives.
//! - **Pause** stops applying updates (the connection stays open), so that the page can be
//!   read; rows are updated in place, so a selection or a tooltip survives the updates.
//!
//! # Cost to the supervisor
//!
//! The console never slows the supervisor's mailbox: one sampler per console (whatever the
//! number of browsers) reads [`Supervisor::leases`](leasehold::Supervisor::leases) and
//! [`Supervisor::stats`](leasehold::Supervisor::stats) every [`SAMPLE_INTERVAL`], synchronous
//! snapshots that send the actor no message, and publishes one JSON frame that every event
//! stream shares. The two calls that message the actor,
//! [`Supervisor::quarantined`](leasehold::Supervisor::quarantined) (for the reasons) and
//! [`Supervisor::waiters`](leasehold::Supervisor::waiters) (for the queue's callers, their classes
//! and wait times), are made at most once per [`QUARANTINE_POLL_INTERVAL`] each, and only while
//! `Stats::quarantined` (or `Stats::waiting`) is not zero.
//! Actions are messages to the actor, like any caller's.
//!
//! # Security
//!
//! - The console listens on `127.0.0.1` (an ephemeral port) unless the embedder names another
//!   address with [`ConsoleBuilder::bind`]. **Binding a non-loopback address exposes the page
//!   and its JSON (job ids, timings, reasons) to everyone who can reach that address, over
//!   plain HTTP: no TLS, no login.** Put it behind a TLS proxy with its own authentication, or
//!   keep it on loopback and reach it through an SSH tunnel.
//! - Every request must name the console by an IP address, `localhost`, or a host name
//!   allowed with [`ConsoleBuilder::allow_host`] (`Host` header), which defeats DNS
//!   rebinding.
//! - Actions are off unless the embedder passes an [`ActionsToken`]. Then each action must be
//!   a `POST` with `Content-Type: application/json`, carry the token in an
//!   `Authorization: Bearer` header (never a cookie, so a browser never sends it on its own;
//!   compared in constant time), come from the console's own page (`Origin` and
//!   `Sec-Fetch-Site` are checked), and have a body of at most [`MAX_ACTION_BODY`] bytes.
//!   Anything else is refused with a 4xx and a stable [`codes`] code, and changes nothing.
//! - The page loads nothing from elsewhere (no CDN; a strict Content-Security-Policy) and
//!   keeps the token in memory only.
//!
//! # HTTP API
//!
//! | route | method | answer |
//! |---|---|---|
//! | `/` , `/console.js`, `/console.css` | `GET` | the page |
//! | `/api/snapshot` | `GET` | the latest frame (JSON; a few KB whatever the queue and the history) |
//! | `/api/timeline` | `GET` | per slot, the last minute's segments, and the charts of the last five minutes (refreshed about once a second) |
//! | `/api/history` | `GET` | `?code=..&q=..&limit=..&before=..`: the job ends, newest first, filtered by code or label (`unreported`: none yet) and searched by job id; `before` (a row's `seq`) gives the page after that row; `matched` and `newer` say where the page stands |
//! | `/api/queue` | `GET` | `?q=..&limit=..`: the waiting callers of the last listing (less those granted since), in the order they are served, searched by job id |
//! | `/api/events` | `GET` | server-sent events: one frame per message, ten a second |
//! | `/api/actions/cancel` | `POST` | `{"job_id": "render-7", "lease_id": 42}` → `{"ok": true, "cancel_requested": true, ..}` (a request: the job ends in its own time); 409 `CONSOLE_TARGET_CHANGED` when lease 42 is no longer that job's, 409 `CONSOLE_TARGET_AMBIGUOUS` when the job id names another caller too; 404 when no such job waits or runs. Without `lease_id`, every job of that id |
//! | `/api/actions/reclaim` | `POST` | `{"lease_ids": [3]}` (or `{}`: whatever is quarantined) → the reclaimed and still quarantined slots; 409 `CONSOLE_TARGET_CHANGED` when a lease not named is quarantined |
//! | `/api/actions/resize` | `POST` | `{"slots": 8, "from": 4}` → `{"ok": true, "capacity": 8}`; 409 `CONSOLE_TARGET_CHANGED` when the capacity is not `from` |
//!
//! A refusal is `{"error": {"code": "CONSOLE_FORBIDDEN", "message": "..."}}`, with a
//! `"cause"` holding the supervisor's own code when it is the supervisor that refused.

mod charts;
mod error;
mod json;
mod outcomes;
mod router;
mod sampler;
mod server;
mod timeline;

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use error::{ConsoleError, codes};
pub use outcomes::{DEFAULT_HISTORY, JobNote, MAX_LABEL_LEN, Outcomes};

use leasehold::Supervisor;

/// The address a console listens on unless [`ConsoleBuilder::bind`] names another:
/// `127.0.0.1`, on a port the operating system picks ([`ConsoleHandle::url`] says which).
pub const DEFAULT_ADDR: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 0);

/// How often the console samples the supervisor's snapshots and sends a frame to each open
/// event stream.
pub const SAMPLE_INTERVAL: Duration = Duration::from_millis(100);

/// How often, at most, the console asks the supervisor for its quarantined slots (the one
/// call that sends its actor a message), and only while a slot is quarantined.
pub const QUARANTINE_POLL_INTERVAL: Duration = Duration::from_secs(1);

/// How far back the per-slot timeline goes.
pub const TIMELINE_WINDOW: Duration = Duration::from_secs(60);

/// The largest action body accepted, in bytes; a larger one is refused with
/// `CONSOLE_PAYLOAD_TOO_LARGE`.
pub const MAX_ACTION_BODY: usize = 4096;

/// How long an action's body may take to arrive; a slower one is refused with
/// `CONSOLE_REQUEST_TIMEOUT`.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long [`ConsoleHandle::shutdown`] waits for requests in progress before it returns.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// How many event streams may be open at once (one per browser tab); one more is refused with
/// `CONSOLE_TOO_MANY_STREAMS` (429). The page is never locked out by it: a refused stream makes
/// it poll `/api/snapshot` once a second and try the stream again every few seconds. A stream
/// whose client stops reading is closed by [`ConsoleBuilder::write_timeout`], which frees its
/// place.
pub const MAX_STREAMS: usize = 16;

/// How many connections the console serves at once unless
/// [`ConsoleBuilder::max_connections`] says otherwise: one more is closed at once. The console
/// holds at most this many sockets (and its listener), well under a common limit of 1 024 file
/// descriptors, so that a flood of clients never takes the descriptors jobs need.
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;

/// How long a client may take to send a request's headers (and how long a kept-alive
/// connection may stay idle) unless [`ConsoleBuilder::header_read_timeout`] says otherwise:
/// then hyper closes the connection.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a write to a client's connection may make no progress (the client has stopped
/// reading, and the socket's buffers are full) unless [`ConsoleBuilder::write_timeout`] says
/// otherwise: then the connection is closed.
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// The shortest actions token accepted, in bytes.
pub const MIN_TOKEN_LEN: usize = 16;

/// The largest capacity the console's resize action sets (a larger one is refused with
/// `CONSOLE_BAD_REQUEST`; [`Supervisor::resize`] itself takes more).
pub const MAX_RESIZE_SLOTS: u32 = 4096;

/// The most lanes shown for the slots below the capacity (held slots are always shown).
const MAX_LANES: usize = 256;

/// The entry point: [`Console::builder`].
#[derive(Debug)]
pub struct Console {
    _priv: (),
}

impl Console {
    /// Starts configuring a console of this supervisor. The console keeps a clone of the
    /// handle while it runs (so the supervisor lives at least as long as its console).
    pub fn builder(supervisor: Supervisor) -> ConsoleBuilder {
        ConsoleBuilder {
            supervisor,
            addr: DEFAULT_ADDR,
            token: None,
            allowed_hosts: Vec::new(),
            limits: server::Limits {
                max_connections: DEFAULT_MAX_CONNECTIONS,
                header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
                write_timeout: DEFAULT_WRITE_TIMEOUT,
            },
            history: DEFAULT_HISTORY,
        }
    }
}

/// The secret that turns the console's actions on. Sent by the page in an
/// `Authorization: Bearer` header and compared in constant time. Its `Debug` never shows it.
#[derive(Clone)]
pub struct ActionsToken {
    secret: Arc<str>,
}

impl ActionsToken {
    /// A token of the embedder's choosing: at least [`MIN_TOKEN_LEN`] bytes of printable ASCII
    /// without spaces (it travels in an HTTP header).
    ///
    /// # Errors
    ///
    /// [`ConsoleError::InvalidToken`] (`CONSOLE_TOKEN_INVALID`) for a shorter token or one
    /// with another character.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold_console::ActionsToken;
    ///
    /// let token = ActionsToken::new("correct-horse-battery-staple")?;
    /// assert_eq!(token.expose(), "correct-horse-battery-staple");
    /// assert_eq!(ActionsToken::new("hunter2").unwrap_err().code(), "CONSOLE_TOKEN_INVALID");
    /// # Ok::<(), leasehold_console::ConsoleError>(())
    /// ```
    pub fn new(secret: impl Into<String>) -> Result<Self, ConsoleError> {
        let secret: String = secret.into();
        if secret.len() < MIN_TOKEN_LEN {
            return Err(ConsoleError::InvalidToken {
                why: "shorter than 16 bytes",
            });
        }
        if !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConsoleError::InvalidToken {
                why: "only printable ASCII without spaces can travel in a header",
            });
        }
        Ok(Self {
            secret: Arc::from(secret),
        })
    }

    /// A fresh token of 32 random bytes from the operating system (64 hex digits), for an
    /// embedder that prints it for its user, as the demos do.
    ///
    /// # Errors
    ///
    /// [`ConsoleError::Random`] (`CONSOLE_RANDOM_FAILED`) when the operating system's random
    /// source fails.
    pub fn random() -> Result<Self, ConsoleError> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|e| ConsoleError::Random {
            message: e.to_string(),
        })?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Self::new(hex)
    }

    /// The secret itself, to hand to the user who will paste it into the page.
    pub fn expose(&self) -> &str {
        &self.secret
    }
}

impl fmt::Debug for ActionsToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ActionsToken(..)")
    }
}

/// Configures a console; [`start`](Self::start) serves it.
#[derive(Debug)]
#[must_use = "a console builder does nothing until `.start().await`"]
pub struct ConsoleBuilder {
    supervisor: Supervisor,
    addr: SocketAddr,
    token: Option<ActionsToken>,
    allowed_hosts: Vec<String>,
    limits: server::Limits,
    history: usize,
}

impl ConsoleBuilder {
    /// Keeps the last `n` job ends in the history (default [`DEFAULT_HISTORY`]; at least a
    /// frame's worth): the page filters it by code and searches it by job id, and shows each
    /// end's detail. The oldest go first.
    pub fn history(mut self, n: usize) -> Self {
        self.history = n;
        self
    }

    /// Serves at most `n` connections at once (at least 1; default
    /// [`DEFAULT_MAX_CONNECTIONS`]): one more is closed at once, before anything is read. An
    /// open event stream holds one.
    pub fn max_connections(mut self, n: usize) -> Self {
        self.limits.max_connections = n.max(1);
        self
    }

    /// Closes a connection whose client has not sent a request's headers within `timeout`
    /// (default [`DEFAULT_HEADER_READ_TIMEOUT`]), and a kept-alive connection idle that long:
    /// a client slow or silent in sending a request's headers holds a connection no longer
    /// than this. It bounds reading the headers only (an action's body has [`BODY_TIMEOUT`]);
    /// a client that stops reading the answer is bounded by [`write_timeout`](Self::write_timeout).
    /// Zero is refused by [`start`](Self::start) (`CONSOLE_LIMIT_INVALID`): it would close
    /// every connection before its request is read.
    pub fn header_read_timeout(mut self, timeout: Duration) -> Self {
        self.limits.header_read_timeout = timeout;
        self
    }

    /// Closes a connection when a write to it has made no progress for `timeout` (default
    /// [`DEFAULT_WRITE_TIMEOUT`]): a client that stops reading an event stream or a large
    /// answer holds its connection (and its event stream's place) no longer than this after
    /// the socket's buffers have filled. Any progress restarts the bound, so a slow reader is
    /// served however long the answer; a connection with nothing to write is not bounded by it
    /// (an open event stream writes ten frames a second).
    /// Zero is refused by [`start`](Self::start) (`CONSOLE_LIMIT_INVALID`): it would close a
    /// connection whenever a write cannot complete at once (the socket's buffer full for a
    /// moment), however fast its client reads.
    pub fn write_timeout(mut self, timeout: Duration) -> Self {
        self.limits.write_timeout = timeout;
        self
    }

    /// Listens on this address instead of [`DEFAULT_ADDR`] (`127.0.0.1`, a port the operating
    /// system picks). Port 0 picks a free port.
    ///
    /// **Risk**: an address other than loopback (`0.0.0.0`, a LAN address) serves the page
    /// and the JSON API, unencrypted and without a login, to everyone who can reach it; with
    /// actions on, the token is then the only guard on cancel, reclaim and resize, and it
    /// crosses that network in clear. A `tracing` warning is logged when a non-loopback
    /// address is bound.
    pub fn bind(mut self, addr: SocketAddr) -> Self {
        self.addr = addr;
        self
    }

    /// Turns actions on (cancel a job, reclaim quarantined slots, resize), each guarded by
    /// this token. Without it, every action is refused with `CONSOLE_ACTIONS_DISABLED`.
    pub fn actions(mut self, token: ActionsToken) -> Self {
        self.token = Some(token);
        self
    }

    /// Also answers requests whose `Host` is this name (any port), say the name of the
    /// machine behind a proxy. IP addresses and `localhost` are always answered; any other
    /// name is refused with `CONSOLE_HOST_REFUSED`, which is what keeps a web page that
    /// rebinds its own domain to the console's address from reading it.
    pub fn allow_host(mut self, name: impl Into<String>) -> Self {
        self.allowed_hosts.push(name.into().to_ascii_lowercase());
        self
    }

    /// Binds the address and starts serving, on the tokio runtime this is awaited on (start
    /// it from the supervisor's runtime so that the console shares it): the HTTP server, the
    /// sampler and the quarantine poller are tasks of that runtime. Answers once the address
    /// is bound; the first frame follows within [`SAMPLE_INTERVAL`].
    ///
    /// # Errors
    ///
    /// [`ConsoleError::Bind`] (`CONSOLE_BIND_FAILED`) when the address cannot be bound;
    /// [`ConsoleError::ZeroTimeout`] (`CONSOLE_LIMIT_INVALID`) when a timeout of the limits is
    /// zero (nothing is bound then).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: nothing is spawned before the address is bound, and dropping the future
    /// before then closes the listener; no task is left behind.
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// use leasehold::Supervisor;
    /// use leasehold_console::Console;
    ///
    /// let sup = Supervisor::builder().slots(2).start().await?;
    /// let console = Console::builder(sup.clone()).start().await?;
    /// assert!(console.local_addr().ip().is_loopback());
    /// assert!(console.url().starts_with("http://127.0.0.1:"));
    /// console.shutdown().await?;
    /// sup.shutdown().await?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn start(self) -> Result<ConsoleHandle, ConsoleError> {
        let Self {
            supervisor,
            addr,
            token,
            allowed_hosts,
            limits,
            history,
        } = self;
        for (what, timeout) in [
            ("header_read_timeout", limits.header_read_timeout),
            ("write_timeout", limits.write_timeout),
        ] {
            if timeout.is_zero() {
                return Err(ConsoleError::ZeroTimeout { what });
            }
        }
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| ConsoleError::Bind { addr, source })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| ConsoleError::Bind { addr, source })?;
        let exposed = !local_addr.ip().is_loopback();
        if exposed {
            // Loud, on stderr too: an embedder that installed no tracing subscriber must see it.
            let warning = format!(
                "WARNING: the leasehold console listens on {local_addr}, beyond this machine: \
                 anyone who can reach that address reads the page and its JSON over plain HTTP \
                 (no TLS, no login)"
            );
            eprintln!("{warning}");
            tracing::warn!(addr = %local_addr, "{warning}");
        }
        let t0 = Instant::now();
        let stop = CancellationToken::new();
        let outcomes = Outcomes::new(t0, history);
        let reasons: sampler::Reasons = Arc::new(Mutex::new(Default::default()));
        let waiters: sampler::Waiters = Arc::new(Mutex::new(sampler::Listing::default()));
        let mut first = sampler::Sampler::new(
            supervisor.clone(),
            t0,
            (token.is_some(), exposed),
            outcomes.clone(),
            (Arc::clone(&reasons), Arc::clone(&waiters)),
        );
        // The first frame now, so that the snapshot route never serves an empty one.
        let (frames_tx, frames_rx) = watch::channel(Arc::<str>::from(first.sample()));
        let (timeline_tx, timeline_rx) = watch::channel(Arc::<str>::from(first.timeline_json()));
        let app = Arc::new(router::App {
            sup: supervisor.clone(),
            frames: frames_rx,
            timeline: timeline_rx,
            outcomes: outcomes.clone(),
            waiters: Arc::clone(&waiters),
            token,
            allowed_hosts,
            streams: AtomicUsize::new(0),
            stop: stop.clone(),
        });
        let sampler = tokio::spawn(sampler::run(first, (frames_tx, timeline_tx), stop.clone()));
        let poller = tokio::spawn(sampler::poll_actor(
            supervisor,
            (reasons, waiters),
            stop.clone(),
        ));
        let server = {
            let stop = stop.clone();
            tokio::spawn(
                async move { server::serve(listener, router::router(app), limits, stop).await },
            )
        };
        let url = match local_addr {
            SocketAddr::V4(a) => format!("http://{}:{}/", a.ip(), a.port()),
            SocketAddr::V6(a) => format!("http://[{}]:{}/", a.ip(), a.port()),
        };
        Ok(ConsoleHandle {
            addr: local_addr,
            url,
            outcomes,
            stop,
            tasks: Some(Tasks {
                server,
                sampler,
                poller,
            }),
        })
    }
}

struct Tasks {
    server: JoinHandle<std::io::Result<()>>,
    sampler: JoinHandle<()>,
    poller: JoinHandle<()>,
}

/// A running console. Dropping it stops the console (its tasks end on their own, open event
/// streams end); [`shutdown`](Self::shutdown) also waits for them.
#[must_use = "dropping the handle stops the console at once"]
pub struct ConsoleHandle {
    addr: SocketAddr,
    url: String,
    outcomes: Outcomes,
    stop: CancellationToken,
    tasks: Option<Tasks>,
}

impl fmt::Debug for ConsoleHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsoleHandle")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl ConsoleHandle {
    /// The address the console listens on (with the port the operating system picked).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The page's URL, e.g. `http://127.0.0.1:41237/`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The handle that feeds the "last outcomes" list with jobs' stable codes.
    pub fn outcomes(&self) -> Outcomes {
        self.outcomes.clone()
    }

    /// Stops the console: stops accepting connections, ends every event stream, lets requests
    /// in progress finish, and waits for its tasks. A request still in progress
    /// [`SHUTDOWN_GRACE`] later (a client that stalls mid-request) is not waited for: its
    /// connection ends when that client goes away or a timeout closes it
    /// ([`ConsoleBuilder::header_read_timeout`], [`BODY_TIMEOUT`],
    /// [`ConsoleBuilder::write_timeout`]).
    ///
    /// # Errors
    ///
    /// [`ConsoleError::Server`] (`CONSOLE_SERVER_FAILED`) when the HTTP server had stopped
    /// with an I/O error.
    ///
    /// # Cancel safety
    ///
    /// The console is stopped as soon as this is first polled; dropping the future only stops
    /// the wait for its tasks, which end on their own.
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// use leasehold::Supervisor;
    /// use leasehold_console::Console;
    ///
    /// let sup = Supervisor::builder().slots(1).start().await?;
    /// let console = Console::builder(sup.clone()).start().await?;
    /// let addr = console.local_addr();
    /// console.shutdown().await?;
    /// assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn shutdown(mut self) -> Result<(), ConsoleError> {
        self.stop.cancel();
        let Some(tasks) = self.tasks.take() else {
            return Ok(());
        };
        // A task that panicked has nothing left to wait for; its panic was already reported
        // by the runtime.
        let _ = tasks.sampler.await;
        let _ = tasks.poller.await;
        match tokio::time::timeout(SHUTDOWN_GRACE, tasks.server).await {
            Ok(Ok(Err(source))) => Err(ConsoleError::Server { source }),
            Ok(_) => Ok(()),
            Err(_) => {
                tracing::warn!(
                    "the leasehold console stopped with a request still in progress after {:?}",
                    SHUTDOWN_GRACE
                );
                Ok(())
            }
        }
    }
}

impl Drop for ConsoleHandle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

// Handles are shareable across threads, and the futures of the public async fns are `Send`.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>(_: &T) {}
    send_sync::<ConsoleHandle>();
    send_sync::<ConsoleBuilder>();
    send_sync::<ActionsToken>();
    send_sync::<Outcomes>();
    let builder: ConsoleBuilder = unreachable_value();
    send(&builder.start());
    let handle: ConsoleHandle = unreachable_value();
    send(&handle.shutdown());
};

fn unreachable_value<T>() -> T {
    unreachable!("only used in a never-called type assertion")
}
