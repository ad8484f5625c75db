//! [`EtcdBroker`]: slots shared by several processes (on several hosts) through etcd.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, KeyValue, LeaseGrantOptions,
    PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse, WatchOptions, WatchStream,
};
use parking_lot::Mutex;
use tokio::time::{Instant, sleep, sleep_until, timeout};

use super::{AcquireRequest, BrokerError, BrokerEvents, SlotBroker, SlotToken};

/// Marks every value leasehold writes (and refuses any other).
const FORMAT: &str = "leasehold/v1";
/// The largest pool an `EtcdBroker` manages (slot keys have six digits).
const MAX_CAPACITY: u32 = 100_000;

/// How an [`EtcdBroker`] reaches etcd and which pool it serves.
///
/// The password (when set) is never printed: `Debug` shows `"<redacted>"`.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use leasehold::EtcdConfig;
///
/// let config = EtcdConfig::new(["http://127.0.0.1:2379"], "render", 3)
///     .key_prefix("studio/leasehold")
///     .ttl(Duration::from_secs(10))
///     .user("farm", "s3cret");
/// assert!(!format!("{config:?}").contains("s3cret"));
/// ```
#[derive(Clone)]
pub struct EtcdConfig {
    endpoints: Vec<String>,
    key_prefix: String,
    pool: String,
    capacity: u32,
    ttl: Duration,
    rpc_timeout: Duration,
    connect_timeout: Duration,
    retry_for: Duration,
    user: Option<(String, String)>,
    #[cfg(feature = "etcd-tls")]
    tls: Option<etcd_client::TlsOptions>,
}

impl EtcdConfig {
    /// A pool named `pool` of `capacity` slots on the etcd cluster at `endpoints`
    /// (`http://host:port`, or `https://` with TLS). Defaults: key prefix `leasehold`, TTL 10 s,
    /// 2 s per call, 5 s to connect, 10 s of retries per step.
    pub fn new<S: AsRef<str>>(
        endpoints: impl IntoIterator<Item = S>,
        pool: impl Into<String>,
        capacity: u32,
    ) -> Self {
        Self {
            endpoints: endpoints
                .into_iter()
                .map(|e| e.as_ref().to_owned())
                .collect(),
            key_prefix: "leasehold".to_owned(),
            pool: pool.into(),
            capacity,
            ttl: Duration::from_secs(10),
            rpc_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(5),
            retry_for: Duration::from_secs(10),
            user: None,
            #[cfg(feature = "etcd-tls")]
            tls: None,
        }
    }

    /// The key prefix under which pools live (default `leasehold`; no trailing `/`).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// The etcd lease TTL, in whole seconds, at least 2 s (default 10 s). A holder that cannot
    /// renew within it loses its slot to the next waiter; a crashed holder's slot returns
    /// after it.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The bound of one etcd call (default 2 s). A call without an answer in time is retried
    /// with the same ids.
    pub fn rpc_timeout(mut self, bound: Duration) -> Self {
        self.rpc_timeout = bound;
        self
    }

    /// The bound of the first connection (default 5 s).
    pub fn connect_timeout(mut self, bound: Duration) -> Self {
        self.connect_timeout = bound;
        self
    }

    /// How long one step of an acquire or a release retries calls whose answer was lost
    /// (default 10 s). After it the call fails with
    /// [`BrokerErrorKind::DeliveryUnknown`](crate::BrokerErrorKind::DeliveryUnknown) and the
    /// lease is left to a background revoke or to its TTL.
    pub fn retry_for(mut self, bound: Duration) -> Self {
        self.retry_for = bound;
        self
    }

    /// Authenticates as `name` (etcd user/password auth). The password is never logged.
    pub fn user(mut self, name: impl Into<String>, password: impl Into<String>) -> Self {
        self.user = Some((name.into(), password.into()));
        self
    }

    /// TLS to etcd (feature `etcd-tls`): CA certificate, optional client identity, domain name.
    #[cfg(feature = "etcd-tls")]
    pub fn tls(mut self, tls: etcd_client::TlsOptions) -> Self {
        self.tls = Some(tls);
        self
    }

    fn validate(&self) -> Result<(), EtcdError> {
        let bad = |msg: String| Err(EtcdError::new(EtcdErrorKind::InvalidConfig, msg));
        if self.endpoints.is_empty() {
            return bad("no etcd endpoint given".into());
        }
        let name_ok = |s: &str| {
            !s.is_empty()
                && s.len() <= 128
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        };
        if !name_ok(&self.pool) {
            return bad(format!(
                "pool name {:?} must be 1-128 characters of [A-Za-z0-9._-]",
                self.pool
            ));
        }
        if !self.key_prefix.split('/').all(name_ok) {
            return bad(format!(
                "key prefix {:?} must be `/`-separated non-empty parts of [A-Za-z0-9._-]",
                self.key_prefix
            ));
        }
        if self.capacity == 0 || self.capacity > MAX_CAPACITY {
            return bad(format!(
                "capacity {} is outside 1..={MAX_CAPACITY}",
                self.capacity
            ));
        }
        if self.ttl < Duration::from_secs(2) || self.ttl.subsec_nanos() != 0 {
            return bad(format!(
                "ttl {:?} must be whole seconds, at least 2 s",
                self.ttl
            ));
        }
        if self.rpc_timeout.is_zero() || self.retry_for.is_zero() {
            return bad("rpc_timeout and retry_for must be above zero".into());
        }
        Ok(())
    }
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("EtcdConfig");
        d.field("endpoints", &self.endpoints)
            .field("key_prefix", &self.key_prefix)
            .field("pool", &self.pool)
            .field("capacity", &self.capacity)
            .field("ttl", &self.ttl)
            .field("rpc_timeout", &self.rpc_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("retry_for", &self.retry_for)
            .field(
                "user",
                &self.user.as_ref().map(|(name, _)| (name, "<redacted>")),
            );
        #[cfg(feature = "etcd-tls")]
        d.field("tls", &self.tls.is_some());
        d.finish()
    }
}

/// What went wrong with etcd, with a stable [`code`](EtcdError::code).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EtcdErrorKind {
    /// `ETCD_INVALID_CONFIG`: the [`EtcdConfig`] was refused before any call.
    InvalidConfig,
    /// `ETCD_UNAVAILABLE`: etcd did not answer (down, no leader, unreachable) within the bound.
    Unavailable,
    /// `ETCD_AUTH_FAILED`: authentication or permission refused.
    Auth,
    /// `ETCD_CAPACITY_MISMATCH`: the pool was created with another capacity.
    CapacityMismatch,
    /// `ETCD_CORRUPT_RECORD`: a key of leasehold's layout holds a value leasehold did not write.
    CorruptRecord,
    /// `ETCD_FOREIGN_KEY`: a key under the pool prefix that is not part of leasehold's layout.
    ForeignKey,
    /// `ETCD_TOKEN_NOT_OURS`: a token this broker did not grant (or already released).
    NotOurs,
    /// `ETCD_LEASE_LOST`: the etcd lease expired or was revoked under its holder.
    LeaseLost,
    /// `ETCD_INVALID_RESPONSE`: etcd answered something that makes no sense (a lease id other
    /// than the one asked for, a lease id taken by someone else).
    InvalidResponse,
    /// `ETCD_TLS_FAILED`: a certificate was refused (the server's by this client, or this
    /// client's, or its absence, by the server).
    Tls,
}

/// A failure of the etcd broker. Never contains credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdError {
    kind: EtcdErrorKind,
    message: String,
}

impl EtcdError {
    fn new(kind: EtcdErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// What went wrong.
    pub fn kind(&self) -> EtcdErrorKind {
        self.kind
    }

    /// The stable code (`ETCD_…`, see [`EtcdErrorKind`]).
    pub fn code(&self) -> &'static str {
        match self.kind {
            EtcdErrorKind::InvalidConfig => "ETCD_INVALID_CONFIG",
            EtcdErrorKind::Unavailable => "ETCD_UNAVAILABLE",
            EtcdErrorKind::Auth => "ETCD_AUTH_FAILED",
            EtcdErrorKind::CapacityMismatch => "ETCD_CAPACITY_MISMATCH",
            EtcdErrorKind::CorruptRecord => "ETCD_CORRUPT_RECORD",
            EtcdErrorKind::ForeignKey => "ETCD_FOREIGN_KEY",
            EtcdErrorKind::NotOurs => "ETCD_TOKEN_NOT_OURS",
            EtcdErrorKind::LeaseLost => "ETCD_LEASE_LOST",
            EtcdErrorKind::InvalidResponse => "ETCD_INVALID_RESPONSE",
            EtcdErrorKind::Tls => "ETCD_TLS_FAILED",
        }
    }

    /// The detail.
    pub fn message(&self) -> &str {
        &self.message
    }

    fn into_broker(self) -> BrokerError {
        let code = self.code();
        let err = match self.kind {
            EtcdErrorKind::Unavailable => BrokerError::unavailable(self.message),
            EtcdErrorKind::Auth
            | EtcdErrorKind::Tls
            | EtcdErrorKind::InvalidConfig
            | EtcdErrorKind::LeaseLost => BrokerError::new(self.message),
            _ => BrokerError::invalid_response(self.message),
        };
        err.with_code(code)
    }
}

impl fmt::Display for EtcdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code(), self.message)
    }
}

impl std::error::Error for EtcdError {}

/// A [`SlotBroker`] whose slots live in etcd and are shared by every broker (in any process,
/// on any host) configured with the same endpoints, key prefix and pool.
///
/// Create it with [`EtcdBroker::connect`] and hand it to
/// [`SupervisorBuilder::broker`](crate::SupervisorBuilder::broker) (an `Arc<EtcdBroker>` works
/// too, to keep observing it).
///
/// # Layout
///
/// Everything lives under `{key_prefix}/{pool}/`, and nothing else may:
///
/// | key | value | lease |
/// |---|---|---|
/// | `capacity` | `leasehold/v1 capacity=N` | none: written once, compared by every broker |
/// | `queue/{lease:016x}` | `leasehold/v1 waiter owner=… request=…` | the waiter's lease |
/// | `slot/{index:06}` | `leasehold/v1 holder lease={lease:016x}` | the holder's lease |
///
/// # Protocol
///
/// One acquire is one etcd lease, whose id is derived from the broker's random owner id and the
/// supervisor's [`AcquireRequest::request_id`]: a retry of an ambiguous call finds what the first
/// attempt already did (a grant says "lease already exists", the queue key is put only if
/// absent, a slot already held under the lease is found and returned) and never takes a second
/// slot. The waiter's queue key orders the pool FIFO by create revision; the first `k` waiters
/// may claim the `k` free slots, each with a transaction that requires the slot key to be absent
/// and the waiter's own queue key to be unchanged. Waiting is a watch on the pool prefix: no
/// polling. The slot key's create revision (strictly increasing across the whole etcd cluster)
/// is the token's lease id, and so its fencing token.
///
/// While a token is held the supervisor drives [`SlotBroker::keep_alive`], which renews the
/// lease every third of its TTL and resolves as soon as a renewal may not arrive in time.
/// Release revokes the lease ("not found" counts as released). A lease that nobody holds any
/// more (an acquire given up, a release whose answer was lost) is an orphan: a background task
/// revokes it, or, when it is unreachable until the TTL has run out, sees it expired and
/// reports it through [`BrokerEvents::orphan_expired`].
///
/// # Examples
///
/// ```no_run
/// use leasehold::{EtcdBroker, EtcdConfig, Supervisor};
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let config = EtcdConfig::new(["http://127.0.0.1:2379"], "render", 3);
/// let broker = EtcdBroker::connect(config).await?;
/// let sup = Supervisor::builder().broker(broker).start().await?;
/// let mut lease = sup.acquire().await?;
/// println!("fencing token {}", lease.lease_id()?);
/// lease.release().await?;
/// # Ok(()) }
/// ```
pub struct EtcdBroker {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    capacity: u32,
    ttl: Duration,
    rpc_timeout: Duration,
    retry_for: Duration,
    connect_timeout: Duration,
    /// `{key_prefix}/{pool}/`.
    prefix: String,
    /// Random per broker: request ids are only unique per supervisor.
    nonce: u64,
    /// Tokens this broker granted and has not released → (etcd lease, when last renewed,
    /// the requesting supervisor's origin).
    held: Mutex<HashMap<SlotToken, (i64, Instant, u64)>>,
    /// Woken when a token is released: its slot index may be handed out again.
    released: tokio::sync::Notify,
    /// A slot index likely to be free (the fast path's first guess).
    hint: AtomicU32,
    /// Lease ids whose grant this broker has sent (a later "already exists" is its own).
    sent: Mutex<HashSet<i64>>,
    /// Orphaned leases being settled in the background.
    orphans: Mutex<HashMap<i64, Arc<OrphanCtl>>>,
    /// Request lease id → epoch, bumped when a retry had to give up an earlier lease id.
    epochs: Mutex<HashMap<i64, u32>>,
    /// Lease ids a revoke was sent for: never granted again (a late revoke could land).
    retired: Mutex<HashSet<i64>>,
    orphans_expired: AtomicU64,
    events: Mutex<Vec<BrokerEvents>>,
}

impl fmt::Debug for EtcdBroker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBroker")
            .field("prefix", &self.inner.prefix)
            .field("capacity", &self.inner.capacity)
            .field("ttl", &self.inner.ttl)
            .field("owner", &format_args!("{:016x}", self.inner.nonce))
            .finish_non_exhaustive()
    }
}

/// How one etcd call failed, once classified.
#[derive(Debug)]
enum Fail {
    /// No answer, or a transient refusal: the effect may or may not have happened.
    Ambiguous(String),
    /// etcd said the lease already exists.
    AlreadyExists,
    /// etcd said the lease does not exist.
    NotFound,
    /// A definite refusal.
    Fatal(EtcdError),
}

impl Fail {
    fn into_etcd(self, what: &str) -> EtcdError {
        match self {
            Fail::Ambiguous(m) => {
                EtcdError::new(EtcdErrorKind::Unavailable, format!("{what}: {m}"))
            }
            Fail::AlreadyExists => EtcdError::new(
                EtcdErrorKind::InvalidResponse,
                format!("{what}: lease already exists"),
            ),
            Fail::NotFound => EtcdError::new(
                EtcdErrorKind::LeaseLost,
                format!("{what}: the lease no longer exists (expired or revoked)"),
            ),
            Fail::Fatal(e) => e,
        }
    }
}

/// The error's message with its sources (tonic keeps the TLS or transport cause there).
fn chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    out
}

fn classify(err: etcd_client::Error) -> Fail {
    use etcd_client::Error as E;
    let text = chain(&err);
    // A certificate refused on either side is a definite answer, not an outage.
    if [
        "invalid peer certificate",
        "InvalidCertificate",
        "certificate required",
        "UnknownIssuer",
    ]
    .iter()
    .any(|m| text.contains(m))
    {
        return Fail::Fatal(EtcdError::new(EtcdErrorKind::Tls, format!("etcd: {text}")));
    }
    match err {
        E::GRpcStatus(status) => {
            let msg = status.message();
            if msg.contains("lease already exists") {
                return Fail::AlreadyExists;
            }
            if msg.contains("requested lease not found") {
                return Fail::NotFound;
            }
            if [
                "authentication failed",
                "user name is empty",
                "permission denied",
                "auth token",
            ]
            .iter()
            .any(|m| msg.contains(m))
            {
                return Fail::Fatal(EtcdError::new(EtcdErrorKind::Auth, format!("etcd: {msg}")));
            }
            match i32::from(status.code()) {
                // Cancelled, Unknown (transport), DeadlineExceeded, ResourceExhausted, Aborted,
                // Internal (an HTTP/2 stream reset when etcd dies mid-call), Unavailable.
                1 | 2 | 4 | 8 | 10 | 13 | 14 => Fail::Ambiguous(format!("etcd: {text}")),
                // PermissionDenied, Unauthenticated.
                7 | 16 => Fail::Fatal(EtcdError::new(EtcdErrorKind::Auth, format!("etcd: {msg}"))),
                _ => Fail::Fatal(EtcdError::new(
                    EtcdErrorKind::InvalidResponse,
                    format!("etcd refused: {msg}"),
                )),
            }
        }
        E::TransportError(_) => Fail::Ambiguous(format!("transport: {text}")),
        E::IoError(_) => Fail::Ambiguous(format!("io: {text}")),
        E::WatchError(e) => Fail::Ambiguous(format!("watch: {e}")),
        // The client's own keep-alive reads the first answer: a TTL of 0 means the lease is
        // gone, for certain.
        E::LeaseKeepAliveError(e) if e.contains("lease not found") => Fail::NotFound,
        E::LeaseKeepAliveError(e) => Fail::Ambiguous(format!("keep-alive: {e}")),
        E::InvalidArgs(_) | E::InvalidUri(_) | E::EndpointError(_) => Fail::Fatal(EtcdError::new(
            EtcdErrorKind::InvalidConfig,
            format!("etcd client refused the configuration: {text}"),
        )),
        _ => Fail::Fatal(EtcdError::new(
            EtcdErrorKind::InvalidResponse,
            format!("etcd client: {text}"),
        )),
    }
}

/// What the pool looks like at one revision, validated.
#[derive(Debug, Default)]
struct Snapshot {
    revision: i64,
    capacity: Option<u32>,
    /// Waiters: (lease, create revision).
    queue: Vec<(i64, i64)>,
    /// Slot index → (holder lease, create revision).
    slots: HashMap<u32, (i64, i64)>,
}

impl Snapshot {
    fn slot_of(&self, lease: i64) -> Option<(u32, i64)> {
        self.slots
            .iter()
            .find(|(_, (l, _))| *l == lease)
            .map(|(i, (_, rev))| (*i, *rev))
    }

    fn queue_rev(&self, lease: i64) -> Option<i64> {
        self.queue
            .iter()
            .find(|(l, _)| *l == lease)
            .map(|(_, r)| *r)
    }
}

fn shown(bytes: &[u8]) -> String {
    let s = String::from_utf8_lossy(bytes);
    let mut out: String = s.chars().take(120).collect();
    if s.chars().count() > 120 {
        out.push('…');
    }
    format!("{out:?}")
}

fn mix(mut z: u64) -> u64 {
    // splitmix64's finaliser: a bijection, so distinct request ids give distinct lease ids.
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl EtcdBroker {
    /// Connects, records the pool's capacity (or checks it against the one recorded), and
    /// checks that everything under the pool prefix is leasehold's.
    ///
    /// # Errors
    ///
    /// [`EtcdError`]: `ETCD_INVALID_CONFIG`, `ETCD_UNAVAILABLE` (no answer within the connect
    /// bound and the retries), `ETCD_AUTH_FAILED`, `ETCD_CAPACITY_MISMATCH` (the pool exists
    /// with another capacity), `ETCD_CORRUPT_RECORD` or `ETCD_FOREIGN_KEY`.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it writes at most the capacity record, which a later connect reads back.
    pub async fn connect(config: EtcdConfig) -> Result<Self, EtcdError> {
        config.validate()?;
        let mut options = ConnectOptions::new()
            .with_timeout(config.rpc_timeout)
            .with_connect_timeout(config.connect_timeout)
            .with_keep_alive(Duration::from_secs(5), config.rpc_timeout)
            .with_require_leader(true);
        if let Some((name, password)) = &config.user {
            options = options
                .with_user(name.clone(), password.clone())
                .with_auto_token_refresh(true);
        }
        #[cfg(feature = "etcd-tls")]
        if let Some(tls) = config.tls.clone() {
            options = options.with_tls(tls);
        }
        let connected = timeout(
            config.connect_timeout,
            Client::connect(&config.endpoints, Some(options)),
        )
        .await;
        let client = match connected {
            Ok(Ok(client)) => client,
            Ok(Err(err)) => {
                return Err(match classify(err) {
                    Fail::Fatal(e) => e,
                    other => other.into_etcd("connect"),
                });
            }
            Err(_) => {
                return Err(EtcdError::new(
                    EtcdErrorKind::Unavailable,
                    format!(
                        "connect: no answer from {:?} within {:?}",
                        config.endpoints, config.connect_timeout
                    ),
                ));
            }
        };
        let nonce = {
            let mut h = std::hash::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
            );
            h.finish()
        };
        let inner = Arc::new(Inner {
            client,
            capacity: config.capacity,
            ttl: config.ttl,
            rpc_timeout: config.rpc_timeout,
            retry_for: config.retry_for,
            connect_timeout: config.connect_timeout,
            prefix: format!("{}/{}/", config.key_prefix, config.pool),
            nonce,
            held: Mutex::new(HashMap::new()),
            released: tokio::sync::Notify::new(),
            hint: AtomicU32::new(0),
            sent: Mutex::new(HashSet::new()),
            orphans: Mutex::new(HashMap::new()),
            epochs: Mutex::new(HashMap::new()),
            retired: Mutex::new(HashSet::new()),
            orphans_expired: AtomicU64::new(0),
            events: Mutex::new(Vec::new()),
        });
        #[cfg(feature = "etcd-tls")]
        let tls = config.tls.is_some();
        #[cfg(not(feature = "etcd-tls"))]
        let tls = false;
        inner.ensure_capacity().await.map_err(|mut e| {
            if tls && e.kind == EtcdErrorKind::Unavailable {
                // A TLS server that refuses the client's certificate (or its absence) just
                // closes the connection: say what it may have been.
                e.message.push_str(
                    " (over TLS: the server may require a client certificate, or have refused this one)",
                );
            }
            e
        })?;
        Ok(Self { inner })
    }

    /// Orphaned leases (acquires given up, releases whose answer was lost) this broker has seen
    /// expire.
    pub fn orphans_expired(&self) -> u64 {
        self.inner.orphans_expired.load(Ordering::Relaxed)
    }

    /// The pool's key prefix (`{key_prefix}/{pool}/`).
    pub fn pool_prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The etcd lease behind a token this broker holds (for tools and tests).
    pub fn etcd_lease_of(&self, token: SlotToken) -> Option<i64> {
        self.inner.held.lock().get(&token).map(|(lease, ..)| *lease)
    }

    /// The etcd lease id an acquire with this request id uses (the idempotency key).
    pub fn etcd_lease_for(&self, request: &AcquireRequest) -> i64 {
        self.inner.lease_for(request)
    }
}

impl SlotBroker for EtcdBroker {
    async fn acquire(&self, request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        Arc::clone(&self.inner)
            .acquire(&request)
            .await
            .map_err(EtcdError::into_broker)
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        Arc::clone(&self.inner).release(token).await
    }

    fn capacity(&self) -> Option<u32> {
        Some(self.inner.capacity)
    }

    fn renews(&self) -> bool {
        true
    }

    async fn keep_alive(&self, token: SlotToken) -> BrokerError {
        self.inner.keep_alive(token).await.into_broker()
    }

    fn attach(&self, events: BrokerEvents) {
        self.inner.events.lock().push(events);
    }
}

/// Turns a lease that nobody will hold into an orphan when dropped armed (an acquire future
/// dropped mid-way, a failed acquire or release).
struct OrphanGuard {
    inner: Arc<Inner>,
    lease: i64,
    /// The supervisor the lease was for (its orphan expiry is reported to it).
    origin: u64,
    /// The lease is known to have existed (a grant was answered, or a key was put under it).
    known: bool,
    /// A revoke of the lease has been sent without an answer (it may still land).
    revoke_sent: bool,
    armed: bool,
}

impl Drop for OrphanGuard {
    fn drop(&mut self) {
        if self.armed {
            Inner::orphan(
                &self.inner,
                self.lease,
                self.origin,
                self.known,
                self.revoke_sent,
            );
        }
    }
}

/// Where the background revoke of an orphaned lease is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OrphanPhase {
    /// No revoke sent yet: a retry of the same request may take the lease back.
    Pending,
    /// A revoke has been sent (it may still land): a retry must wait and use a new lease id.
    Revoking,
    /// Taken back by a retry; the task stops without revoking.
    Cancelled,
    /// Revoked, expired, or given up.
    Done,
}

struct OrphanCtl {
    phase: Mutex<OrphanPhase>,
    done: tokio::sync::watch::Sender<bool>,
}

/// Ends an orphan's record when its task ends, however it ends.
struct SettleOnDrop {
    inner: Arc<Inner>,
    lease: i64,
    ctl: Arc<OrphanCtl>,
    /// A retry took the lease back: it is live again, so it stays in `sent`.
    taken_back: bool,
}

impl Drop for SettleOnDrop {
    fn drop(&mut self) {
        {
            let mut phase = self.ctl.phase.lock();
            if *phase != OrphanPhase::Cancelled {
                *phase = OrphanPhase::Done;
            }
        }
        self.ctl.done.send_replace(true);
        self.inner.forget_orphan(self.lease, &self.ctl);
        if !self.taken_back {
            self.inner.sent.lock().remove(&self.lease);
        }
    }
}

impl Inner {
    fn lease_for(&self, request: &AcquireRequest) -> i64 {
        let key = mix(request.origin()) ^ mix(mix(request.request_id()));
        let id = mix(self.nonce ^ key) & (i64::MAX as u64);
        id.max(1) as i64
    }

    fn capacity_key(&self) -> String {
        format!("{}capacity", self.prefix)
    }

    fn queue_key(&self, lease: i64) -> String {
        format!("{}queue/{lease:016x}", self.prefix)
    }

    fn slot_key(&self, index: u32) -> String {
        format!("{}slot/{index:06}", self.prefix)
    }

    fn capacity_value(&self) -> String {
        format!("{FORMAT} capacity={}", self.capacity)
    }

    /// One etcd call, bounded by `rpc_timeout`, retried while its answer is lost or etcd is
    /// briefly unavailable, until `deadline`. Every call passed here must be idempotent.
    async fn call<T, F, Fut>(&self, what: &str, deadline: Instant, mut f: F) -> Result<T, Fail>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let mut backoff = Duration::from_millis(20);
        loop {
            let last = match timeout(self.rpc_timeout, f(self.client.clone())).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(err)) => match classify(err) {
                    Fail::Ambiguous(m) => m,
                    definite => return Err(definite),
                },
                Err(_) => format!("no answer within {:?}", self.rpc_timeout),
            };
            let now = Instant::now();
            if now + backoff >= deadline {
                return Err(Fail::Ambiguous(last));
            }
            tracing::debug!(what, error = %last, "etcd call retried");
            sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    fn parse(&self, kvs: &[KeyValue], revision: i64) -> Result<Snapshot, EtcdError> {
        let mut snap = Snapshot {
            revision,
            ..Snapshot::default()
        };
        let foreign = |kv: &KeyValue, why: &str| {
            EtcdError::new(
                EtcdErrorKind::ForeignKey,
                format!(
                    "key {} under the pool prefix {:?} was not written by leasehold ({why}); remove it or use another pool",
                    shown(kv.key()),
                    self.prefix
                ),
            )
        };
        let corrupt = |kv: &KeyValue, why: &str| {
            EtcdError::new(
                EtcdErrorKind::CorruptRecord,
                format!(
                    "key {} holds {} ({why}); leasehold refuses to use the pool",
                    shown(kv.key()),
                    shown(kv.value())
                ),
            )
        };
        for kv in kvs {
            let Some(rest) = kv.key().strip_prefix(self.prefix.as_bytes()) else {
                return Err(foreign(kv, "outside the prefix"));
            };
            let Ok(rest) = std::str::from_utf8(rest) else {
                return Err(foreign(kv, "not UTF-8"));
            };
            let value = std::str::from_utf8(kv.value()).unwrap_or("");
            if rest == "capacity" {
                let n = value
                    .strip_prefix(FORMAT)
                    .and_then(|v| v.strip_prefix(" capacity="))
                    .and_then(|n| n.parse::<u32>().ok())
                    .filter(|n| (1..=MAX_CAPACITY).contains(n))
                    .ok_or_else(|| corrupt(kv, "not a capacity record"))?;
                snap.capacity = Some(n);
            } else if let Some(hex) = rest.strip_prefix("queue/") {
                let lease = parse_lease(hex).ok_or_else(|| foreign(kv, "not a queue key"))?;
                let ok = value.starts_with(&format!("{FORMAT} waiter "));
                if !ok || kv.lease() != lease {
                    return Err(corrupt(kv, "not a waiter record under its own lease"));
                }
                snap.queue.push((lease, kv.create_revision()));
            } else if let Some(index) = rest.strip_prefix("slot/") {
                let index = (index.len() == 6 && index.bytes().all(|b| b.is_ascii_digit()))
                    .then(|| index.parse::<u32>().ok())
                    .flatten()
                    .ok_or_else(|| foreign(kv, "not a slot key"))?;
                if index >= self.capacity {
                    return Err(corrupt(kv, "slot index beyond the pool's capacity"));
                }
                let lease = value
                    .strip_prefix(FORMAT)
                    .and_then(|v| v.strip_prefix(" holder lease="))
                    .and_then(parse_lease)
                    .filter(|l| *l == kv.lease())
                    .ok_or_else(|| corrupt(kv, "not a holder record under its own lease"))?;
                snap.slots.insert(index, (lease, kv.create_revision()));
            } else {
                return Err(foreign(kv, "unknown key"));
            }
        }
        if let Some(n) = snap.capacity
            && n != self.capacity
        {
            return Err(EtcdError::new(
                EtcdErrorKind::CapacityMismatch,
                format!(
                    "pool {:?} was created with capacity {n}, this broker is configured with {}",
                    self.prefix, self.capacity
                ),
            ));
        }
        snap.queue.sort_by_key(|(_, rev)| *rev);
        Ok(snap)
    }

    fn snapshot_from(&self, resp: &etcd_client::GetResponse) -> Result<Snapshot, EtcdError> {
        let revision = resp.header().map_or(0, |h| h.revision());
        let snap = self.parse(resp.kvs(), revision)?;
        if snap.capacity.is_none() {
            return Err(EtcdError::new(
                EtcdErrorKind::CorruptRecord,
                format!("the capacity record {:?} is missing", self.capacity_key()),
            ));
        }
        Ok(snap)
    }

    async fn fetch(&self, deadline: Instant) -> Result<Snapshot, EtcdError> {
        let prefix = self.prefix.clone();
        let resp = self
            .call("read the pool", deadline, |mut c| {
                let prefix = prefix.clone();
                async move { c.get(prefix, Some(GetOptions::new().with_prefix())).await }
            })
            .await
            .map_err(|f| f.into_etcd("read the pool"))?;
        self.snapshot_from(&resp)
    }

    async fn ensure_capacity(&self) -> Result<(), EtcdError> {
        let key = self.capacity_key();
        let value = self.capacity_value();
        // Bounded by the connect timeout: the client connects lazily, on this first call.
        let deadline = Instant::now() + self.connect_timeout;
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.clone(), value, None)]);
        self.call("record the capacity", deadline, |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
        .map_err(|f| f.into_etcd("record the capacity"))?;
        self.fetch(deadline).await.map(|_| ())
    }

    fn owner_value(&self, request_id: u64) -> String {
        format!(
            "{FORMAT} waiter owner={:016x} request={request_id}",
            self.nonce
        )
    }

    /// The lease id this acquire may use: the request's own, unless an earlier attempt's lease
    /// has already been sent a revoke (which might still land), in which case that revoke is
    /// waited for and a fresh lease id (next epoch) is used. Never two live leases for one
    /// request.
    async fn take_over(&self, request: &AcquireRequest) -> Result<i64, EtcdError> {
        let base = self.lease_for(request);
        loop {
            let epoch = self.epochs.lock().get(&base).copied().unwrap_or(0);
            let lease = if epoch == 0 {
                base
            } else {
                (mix(base as u64 ^ mix(u64::from(epoch))) & (i64::MAX as u64)).max(1) as i64
            };
            let Some(ctl) = self.orphans.lock().get(&lease).cloned() else {
                if self.retired.lock().contains(&lease) {
                    // A revoke was sent for this id (it may still land): move to the next epoch.
                    let mut epochs = self.epochs.lock();
                    let next = epochs.entry(base).or_insert(0);
                    if *next == epoch {
                        *next += 1;
                    }
                    continue;
                }
                return Ok(lease);
            };
            let mut done = ctl.done.subscribe();
            {
                let mut phase = ctl.phase.lock();
                if *phase == OrphanPhase::Pending {
                    // No revoke was sent: the retry takes its lease back.
                    *phase = OrphanPhase::Cancelled;
                    drop(phase);
                    self.forget_orphan(lease, &ctl);
                    return Ok(lease);
                }
            }
            let settled = timeout(self.retry_for, done.wait_for(|d| *d)).await;
            if settled.is_err() {
                return Err(EtcdError::new(
                    EtcdErrorKind::Unavailable,
                    format!(
                        "an earlier attempt of this request (lease {lease:016x}) is still being revoked"
                    ),
                ));
            }
            // Settled: the task retired the id once it sent a revoke (next turn moves on).
            self.forget_orphan(lease, &ctl);
        }
    }

    async fn acquire(self: Arc<Self>, request: &AcquireRequest) -> Result<SlotToken, EtcdError> {
        let request_id = request.request_id();
        let lease = self.take_over(request).await?;
        let first_ever = self.sent.lock().insert(lease);
        let mut guard = OrphanGuard {
            inner: Arc::clone(&self),
            lease,
            origin: request.origin(),
            known: false,
            revoke_sent: false,
            armed: true,
        };
        let result: Result<SlotToken, EtcdError> = async {
            let mut renewed;
            let mut snap;
            let mut tries = 0;
            loop {
                tries += 1;
                // 1. The lease. A retry (of this call or of an earlier one with the same request
                //    id) hears "already exists": it is this broker's own grant.
                let attempts = AtomicU32::new(0);
                let ttl = self.ttl.as_secs() as i64;
                // The TTL runs from when etcd applies the grant: at or after this instant.
                let asked_at = Instant::now();
                let granted = self
                    .call("lease grant", asked_at + self.retry_for, |mut c| {
                        attempts.fetch_add(1, Ordering::Relaxed);
                        async move {
                            c.lease_grant(ttl, Some(LeaseGrantOptions::new().with_id(lease)))
                                .await
                        }
                    })
                    .await;
                let mut fresh = false;
                match granted {
                    Ok(resp) if resp.id() == lease && resp.ttl() > 0 => {
                        renewed = asked_at;
                        fresh = true;
                    }
                    Ok(resp) => {
                        return Err(EtcdError::new(
                            EtcdErrorKind::InvalidResponse,
                            format!(
                                "asked for lease {lease:016x}, etcd granted {:016x} with ttl {}",
                                resp.id(),
                                resp.ttl()
                            ),
                        ));
                    }
                    Err(Fail::AlreadyExists)
                        if first_ever && tries == 1 && attempts.load(Ordering::Relaxed) == 1 =>
                    {
                        guard.armed = false; // not ours: never revoke it
                        self.sent.lock().remove(&lease);
                        return Err(EtcdError::new(
                            EtcdErrorKind::InvalidResponse,
                            format!("lease id {lease:016x} is already taken by another client"),
                        ));
                    }
                    Err(Fail::AlreadyExists) => {
                        // Granted by an earlier attempt, at an unknown time: renew now, so that
                        // the renewal clock starts from a known instant.
                        let sent_at = Instant::now();
                        match self.renew_once(lease, sent_at + self.retry_for).await {
                            Ok(()) => renewed = sent_at,
                            Err(Fail::NotFound) if tries < 3 => continue,
                            Err(f) => return Err(f.into_etcd("renew an earlier grant")),
                        }
                    }
                    Err(f) => return Err(f.into_etcd("lease grant")),
                }
                guard.known = true;

                // 2. Join the queue (unless already in it), reading the pool in the same revision.
                //    A lease that vanished in between is granted again.
                let joined = if fresh {
                    self.join_or_claim(lease, request_id).await
                } else {
                    self.enqueue(lease, request_id).await
                };
                match joined {
                    Ok(s) => {
                        snap = s;
                        break;
                    }
                    Err(e) if e.kind() == EtcdErrorKind::LeaseLost && tries < 3 => continue,
                    Err(e) => return Err(e),
                }
            }
            let qkey = self.queue_key(lease);
            let mut watch: Option<WatchStream> = None;
            let renew_every = self.ttl / 3;
            loop {
                // Armed before `held` is read: a local release in between still wakes this waiter.
                let released = self.released.notified();
                tokio::pin!(released);
                released.as_mut().enable();
                if let Some((index, revision)) = snap.slot_of(lease) {
                    let token = SlotToken::new(index, revision as u64);
                    if snap.queue_rev(lease).is_some() {
                        self.delete_own_queue_key(lease).await;
                    }
                    if Instant::now() >= renewed + renew_every {
                        // Slow steps (retries) took a good part of the TTL: renew before the
                        // holder's keep-alive starts counting from `renewed`.
                        let sent_at = Instant::now();
                        self.renew_once(lease, renewed + self.ttl - self.margin())
                            .await
                            .map_err(|f| f.into_etcd("renew the new grant"))?;
                        renewed = sent_at;
                    }
                    self.held
                        .lock()
                        .insert(token, (lease, renewed, request.origin()));
                    guard.armed = false;
                    return Ok(token);
                }
                let Some(my_rev) = snap.queue_rev(lease) else {
                    // The queue key is gone (the lease lapsed, or etcd lost it): join again; a
                    // lapsed lease refuses the put.
                    snap = self.enqueue(lease, request_id).await?;
                    continue;
                };
                // A queue key whose lease already holds a slot is a leftover of a retry (its delete
                // may have failed): not a waiter ahead.
                let ahead = snap
                    .queue
                    .iter()
                    .filter(|(l, r)| *r < my_rev && snap.slot_of(*l).is_none())
                    .count();
                // A slot index this broker still holds a token for is not handed out again, even
                // when etcd has already freed it (a lease lost while its job still winds down):
                // the supervisor would refuse the duplicate slot.
                let local: HashSet<u32> = self.held.lock().keys().map(|t| t.slot_id()).collect();
                let free: Vec<u32> = (0..self.capacity)
                    .filter(|i| !snap.slots.contains_key(i) && !local.contains(i))
                    .collect();
                if let Some(&first) = free.first() {
                    self.hint.store(first, Ordering::Relaxed);
                }
                if let Some(&index) = free.get(ahead) {
                    snap = self.claim(lease, index, &qkey, my_rev).await?;
                    continue;
                }
                // 3. Wait for the pool to change (or a local release), renewing the lease meanwhile.
                if watch.is_none() {
                    let prefix = self.prefix.clone();
                    let start = snap.revision + 1;
                    let made = self
                        .call(
                            "watch the pool",
                            Instant::now() + self.retry_for,
                            |mut c| {
                                let prefix = prefix.clone();
                                async move {
                                    c.watch(
                                        prefix,
                                        Some(
                                            WatchOptions::new()
                                                .with_prefix()
                                                .with_start_revision(start),
                                        ),
                                    )
                                    .await
                                }
                            },
                        )
                        .await
                        .map_err(|f| f.into_etcd("watch the pool"))?;
                    watch = Some(made);
                }
                let stream = watch.as_mut().expect("set above");
                tokio::select! {
                    msg = stream.message() => match msg {
                        Ok(Some(resp)) if !resp.canceled() => {}
                        // Cancelled (compacted past our revision), closed or broken: read the pool
                        // afresh and watch again from there.
                        _ => watch = None,
                    },
                    () = &mut released => {}
                    () = sleep_until(renewed + renew_every) => {
                        let sent_at = Instant::now();
                        // Retried until the lease could lapse, not just once.
                        let lapse_at = renewed + self.ttl - self.margin();
                        self.renew_once(lease, lapse_at)
                            .await
                            .map_err(|f| f.into_etcd("renew while waiting"))?;
                        renewed = sent_at;
                    }
                }
                snap = self.fetch(Instant::now() + self.retry_for).await?;
            }
        }
        .await;
        if let Err(e) = &result
            && guard.known
            && matches!(
                e.kind,
                EtcdErrorKind::ForeignKey
                    | EtcdErrorKind::CorruptRecord
                    | EtcdErrorKind::CapacityMismatch
                    | EtcdErrorKind::InvalidResponse
            )
        {
            // A pool found corrupt after this lease claimed a slot (the claim and the read are
            // one transaction): give the slot back before answering, so the refusal grants
            // nothing, not even for a moment after it.
            let revoked = self
                .call(
                    "revoke after a refusal",
                    Instant::now() + self.rpc_timeout * 2,
                    |mut c| async move { c.lease_revoke(lease).await },
                )
                .await;
            if matches!(revoked, Ok(_) | Err(Fail::NotFound)) {
                guard.armed = false;
                self.sent.lock().remove(&lease);
            } else {
                guard.revoke_sent = true;
            }
        }
        result
    }

    /// The uncontended fast path, for a lease just granted (so no key is under it yet): one
    /// transaction claims a likely-free slot when nobody waits, and otherwise joins the queue;
    /// either way it reads the pool. Saves the separate claim on an idle pool. A retry after a
    /// lost answer finds the claimed slot in the read (or joins the queue, harmlessly: the put
    /// of an existing queue key keeps its create revision, so its place).
    async fn join_or_claim(&self, lease: i64, request_id: u64) -> Result<Snapshot, EtcdError> {
        let local: HashSet<u32> = self.held.lock().keys().map(|t| t.slot_id()).collect();
        let hint = self.hint.load(Ordering::Relaxed);
        let guess = (0..self.capacity)
            .map(|k| (hint.wrapping_add(k)) % self.capacity)
            .find(|i| !local.contains(i));
        let Some(guess) = guess else {
            return self.enqueue(lease, request_id).await;
        };
        let read = TxnOp::get(self.prefix.clone(), Some(GetOptions::new().with_prefix()));
        let txn = Txn::new()
            .when([
                // An empty range compares as one absent key: "nobody waits".
                Compare::version(format!("{}queue/", self.prefix), CompareOp::Equal, 0)
                    .with_prefix(),
                Compare::create_revision(self.slot_key(guess), CompareOp::Equal, 0),
            ])
            .and_then([
                TxnOp::put(
                    self.slot_key(guess),
                    format!("{FORMAT} holder lease={lease:016x}"),
                    Some(PutOptions::new().with_lease(lease)),
                ),
                read.clone(),
            ])
            .or_else([
                TxnOp::put(
                    self.queue_key(lease),
                    self.owner_value(request_id),
                    Some(PutOptions::new().with_lease(lease)),
                ),
                read,
            ]);
        let (claimed, snap) = self.txn_read("claim or join the queue", txn).await?;
        if claimed {
            self.hint
                .store((guess + 1) % self.capacity, Ordering::Relaxed);
        }
        Ok(snap)
    }

    /// Puts the waiter's queue key if absent; returns the pool as of that revision.
    async fn enqueue(&self, lease: i64, request_id: u64) -> Result<Snapshot, EtcdError> {
        let qkey = self.queue_key(lease);
        let read = TxnOp::get(self.prefix.clone(), Some(GetOptions::new().with_prefix()));
        let txn = Txn::new()
            .when([Compare::create_revision(qkey.clone(), CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(
                    qkey,
                    self.owner_value(request_id),
                    Some(PutOptions::new().with_lease(lease)),
                ),
                read.clone(),
            ])
            .or_else([read]);
        Ok(self.txn_read("join the queue", txn).await?.1)
    }

    /// Runs a transaction whose last operation (in either branch) reads the pool, retried
    /// while its answer is lost: whether it succeeded, and the pool as it read it.
    async fn txn_read(&self, what: &str, txn: Txn) -> Result<(bool, Snapshot), EtcdError> {
        let resp = self
            .call(what, Instant::now() + self.retry_for, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await
            .map_err(|f| f.into_etcd(what))?;
        Ok((resp.succeeded(), self.txn_snapshot(&resp)?))
    }

    /// The pool as read by the last `get` of a transaction.
    fn txn_snapshot(&self, resp: &TxnResponse) -> Result<Snapshot, EtcdError> {
        let revision = resp.header().map_or(0, |h| h.revision());
        let get = resp
            .op_responses()
            .into_iter()
            .rev()
            .find_map(|op| match op {
                TxnOpResponse::Get(g) => Some(g),
                _ => None,
            })
            .ok_or_else(|| {
                EtcdError::new(
                    EtcdErrorKind::InvalidResponse,
                    "a transaction answered without the read it was asked for",
                )
            })?;
        let mut snap = self.snapshot_from(&get)?;
        snap.revision = revision;
        Ok(snap)
    }

    /// Claims slot `index` if it is still free and the waiter is still queued as `my_rev`.
    /// Returns the pool after the attempt (holding the slot under `lease` on success).
    async fn claim(
        &self,
        lease: i64,
        index: u32,
        qkey: &str,
        my_rev: i64,
    ) -> Result<Snapshot, EtcdError> {
        let skey = self.slot_key(index);
        let read = TxnOp::get(self.prefix.clone(), Some(GetOptions::new().with_prefix()));
        let txn = Txn::new()
            .when([
                Compare::create_revision(skey.clone(), CompareOp::Equal, 0),
                Compare::create_revision(qkey.to_owned(), CompareOp::Equal, my_rev),
            ])
            .and_then([
                TxnOp::put(
                    skey,
                    format!("{FORMAT} holder lease={lease:016x}"),
                    Some(PutOptions::new().with_lease(lease)),
                ),
                TxnOp::delete(qkey.to_owned(), None),
                read.clone(),
            ])
            .or_else([read]);
        // A retry after a lost answer fails the comparison (the slot now exists under this
        // lease) and reads the pool, where the slot is found.
        Ok(self.txn_read("claim a slot", txn).await?.1)
    }

    async fn delete_own_queue_key(&self, lease: i64) {
        let qkey = self.queue_key(lease);
        let txn = Txn::new()
            .when([Compare::lease(qkey.clone(), CompareOp::Equal, lease)])
            .and_then([TxnOp::delete(qkey, None)]);
        // Idempotent; a leftover that survives is skipped by other waiters and goes with the
        // lease at release.
        let _ = self
            .call(
                "drop a leftover queue key",
                Instant::now() + self.rpc_timeout * 2,
                |mut c| {
                    let txn = txn.clone();
                    async move { c.txn(txn).await }
                },
            )
            .await;
    }

    /// One keep-alive round trip, retried until `deadline`: `Ok` when etcd renewed the lease
    /// (the client's keep-alive reads etcd's first answer, whose TTL must be above zero),
    /// `NotFound` when etcd says the lease is gone.
    async fn renew_once(&self, lease: i64, deadline: Instant) -> Result<(), Fail> {
        self.call("renew", deadline, |mut c| async move {
            c.lease_keep_alive(lease).await.map(|_| ())
        })
        .await
    }

    /// How long before the lease could lapse a holder is told it is lost.
    fn margin(&self) -> Duration {
        (self.ttl / 4).min(Duration::from_secs(2))
    }

    async fn keep_alive(&self, token: SlotToken) -> EtcdError {
        let Some((lease, mut renewed, _)) = self.held.lock().get(&token).copied() else {
            return EtcdError::new(
                EtcdErrorKind::NotOurs,
                format!("{token} was not granted by this broker"),
            );
        };
        let every = self.ttl / 3;
        loop {
            sleep_until(renewed + every).await;
            // Give up (and so cancel the job) while part of the TTL is still left: etcd counts
            // from when it received the last renewal, at or after `renewed`.
            let lapse_at = renewed + self.ttl - self.margin();
            let mut backoff = Duration::from_millis(50);
            loop {
                // Always try at least once: a renewal that gets through proves the lease alive
                // even when this task was late to run.
                let sent_at = Instant::now();
                let bound = self
                    .rpc_timeout
                    .min(lapse_at.saturating_duration_since(sent_at))
                    .max(Duration::from_millis(50));
                match timeout(bound, self.renew_once(lease, sent_at + bound)).await {
                    Ok(Ok(())) => {
                        renewed = sent_at;
                        if let Some(entry) = self.held.lock().get_mut(&token) {
                            entry.1 = sent_at;
                        }
                        break;
                    }
                    Ok(Err(Fail::NotFound)) => {
                        return EtcdError::new(
                            EtcdErrorKind::LeaseLost,
                            format!("lease {lease:016x} of {token} expired or was revoked"),
                        );
                    }
                    Ok(Err(Fail::Fatal(e))) => {
                        tracing::warn!(%token, error = %e, "lease renewal refused; retrying");
                    }
                    _ => {}
                }
                let now = Instant::now();
                if now >= lapse_at {
                    return EtcdError::new(
                        EtcdErrorKind::LeaseLost,
                        format!(
                            "lease {lease:016x} of {token} could not be renewed for {:?}; it may lapse (ttl {:?})",
                            now - renewed,
                            self.ttl
                        ),
                    );
                }
                sleep(backoff.min(lapse_at - now)).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
        }
    }

    async fn release(self: Arc<Self>, token: SlotToken) -> Result<(), BrokerError> {
        let Some((lease, _, origin)) = self.held.lock().remove(&token) else {
            return Err(EtcdError::new(
                EtcdErrorKind::NotOurs,
                format!("{token} was not granted by this broker, or was already released"),
            )
            .into_broker());
        };
        // The slot index is this broker's to hand out again (see `acquire`).
        self.released.notify_waiters();
        self.hint.store(token.slot_id(), Ordering::Relaxed);
        let mut guard = OrphanGuard {
            inner: Arc::clone(&self),
            lease,
            origin,
            known: true,
            revoke_sent: true,
            armed: true,
        };
        let revoked = self
            .call(
                "revoke",
                Instant::now() + self.retry_for,
                |mut c| async move { c.lease_revoke(lease).await },
            )
            .await;
        match revoked {
            // Not found: it already expired (or an earlier attempt whose answer was lost
            // revoked it). Either way the slot is free.
            Ok(_) | Err(Fail::NotFound) => {
                guard.armed = false;
                self.sent.lock().remove(&lease);
                Ok(())
            }
            Err(Fail::Ambiguous(m)) => Err(BrokerError::delivery_unknown(format!(
                "revoke of lease {lease:016x} ({token}) unanswered: {m}; retried in the background, else it expires within its ttl"
            ))
            .with_code("ETCD_UNAVAILABLE")),
            Err(f) => Err(f.into_etcd("revoke").into_broker()),
        }
    }

    /// Takes care of a lease nobody holds: revokes it in the background (retrying while etcd
    /// does not answer), and counts it as expired if etcd no longer knows it by the time it
    /// answers.
    fn orphan(this: &Arc<Self>, lease: i64, origin: u64, known: bool, revoke_sent: bool) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                lease = format_args!("{lease:016x}"),
                "orphaned etcd lease left to its ttl (no runtime)"
            );
            return;
        };
        if revoke_sent {
            this.retired.lock().insert(lease);
        }
        let ctl = Arc::new(OrphanCtl {
            phase: Mutex::new(if revoke_sent {
                OrphanPhase::Revoking
            } else {
                OrphanPhase::Pending
            }),
            done: tokio::sync::watch::Sender::new(false),
        });
        if let Some(earlier) = this.orphans.lock().insert(lease, Arc::clone(&ctl)) {
            // Cannot happen (one owner per lease at a time); never leave a waiter hanging.
            earlier.done.send_replace(true);
        }
        let me = Arc::clone(this);
        rt.spawn(async move {
            // Settles the record even if this task is dropped (runtime shutdown): a retry
            // waiting on it must not wait for ever.
            let settle = SettleOnDrop {
                inner: Arc::clone(&me),
                lease,
                ctl: Arc::clone(&ctl),
                taken_back: false,
            };
            let mut settle = settle;
            settle.taken_back = !me.settle_orphan(lease, origin, known, &ctl).await;
        });
    }

    /// Removes `ctl` from the orphan table, unless a newer record for the lease replaced it.
    fn forget_orphan(&self, lease: i64, ctl: &Arc<OrphanCtl>) {
        let mut orphans = self.orphans.lock();
        if orphans.get(&lease).is_some_and(|c| Arc::ptr_eq(c, ctl)) {
            orphans.remove(&lease);
        }
    }

    /// Returns `false` when a retry took the lease back before any revoke was sent.
    async fn settle_orphan(&self, lease: i64, origin: u64, known: bool, ctl: &OrphanCtl) -> bool {
        let mut backoff = Duration::from_millis(100);
        // etcd holds a lease at most its TTL past its last renewal, counted from a leader that
        // is up: past this bound with no answer at all, stop and leave it to the TTL.
        let give_up = Instant::now() + (self.ttl * 10).max(Duration::from_secs(60));
        loop {
            {
                let mut phase = ctl.phase.lock();
                if *phase == OrphanPhase::Cancelled {
                    return false; // a retry of the same request took the lease back
                }
                *phase = OrphanPhase::Revoking;
                self.retired.lock().insert(lease);
            }
            let mut c = self.client.clone();
            match timeout(self.rpc_timeout, c.lease_revoke(lease)).await {
                Ok(Ok(_)) => {
                    tracing::info!(
                        lease = format_args!("{lease:016x}"),
                        "orphaned etcd lease revoked"
                    );
                    return true;
                }
                Ok(Err(err)) => match classify(err) {
                    Fail::NotFound if known => {
                        self.orphans_expired.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            lease = format_args!("{lease:016x}"),
                            "orphaned etcd lease expired (its ttl ended it, not a release)"
                        );
                        for events in self.events.lock().iter() {
                            if events.origin() == 0 || events.origin() == origin || origin == 0 {
                                events.orphan_expired(lease as u64);
                            }
                        }
                        return true;
                    }
                    Fail::NotFound => {
                        tracing::info!(
                            lease = format_args!("{lease:016x}"),
                            "orphaned etcd lease was never granted, or already expired"
                        );
                        return true;
                    }
                    Fail::Fatal(e) => {
                        tracing::error!(lease = format_args!("{lease:016x}"), error = %e, "orphaned etcd lease cannot be revoked; left to its ttl");
                        return true;
                    }
                    _ => {}
                },
                Err(_) => {}
            }
            if Instant::now() >= give_up {
                tracing::warn!(
                    lease = format_args!("{lease:016x}"),
                    "etcd unreachable for too long: orphaned lease left to its ttl, not counted"
                );
                return true;
            }
            sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }
}

fn parse_lease(hex: &str) -> Option<i64> {
    if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    i64::from_str_radix(hex, 16).ok().filter(|l| *l > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_is_validated_before_any_call_and_never_shows_the_password() {
        let ok = EtcdConfig::new(["http://127.0.0.1:1"], "render", 3).user("u", "hunter2");
        assert!(ok.validate().is_ok());
        assert!(!format!("{ok:?}").contains("hunter2"));
        for bad in [
            EtcdConfig::new(["http://127.0.0.1:1"], "", 3),
            EtcdConfig::new(["http://127.0.0.1:1"], "a/b", 3),
            EtcdConfig::new(["http://127.0.0.1:1"], "p", 0),
            EtcdConfig::new(["http://127.0.0.1:1"], "p", 3).key_prefix("a//b"),
            EtcdConfig::new(["http://127.0.0.1:1"], "p", 3).key_prefix("x/"),
            EtcdConfig::new(["http://127.0.0.1:1"], "p", 3).ttl(Duration::from_millis(1500)),
            EtcdConfig::new(Vec::<String>::new(), "p", 3),
        ] {
            let err = bad.validate().unwrap_err();
            assert_eq!(err.code(), "ETCD_INVALID_CONFIG", "{bad:?}");
        }
    }

    #[test]
    fn lease_ids_are_positive_and_differ_per_request() {
        let ids: HashSet<i64> = (0..10_000u64)
            .map(|r| (mix(42 ^ mix(r)) & (i64::MAX as u64)).max(1) as i64)
            .collect();
        assert_eq!(ids.len(), 10_000);
        assert!(ids.iter().all(|i| *i > 0));
    }

    #[test]
    fn lease_hex_parsing_refuses_anything_but_sixteen_hex_digits() {
        assert_eq!(parse_lease("000000000000002a"), Some(42));
        for bad in [
            "2a",
            "000000000000002g",
            "0000000000000000",
            "ffffffffffffffff",
        ] {
            assert_eq!(parse_lease(bad), None, "{bad}");
        }
    }
}
