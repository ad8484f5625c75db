//! [`EtcdError`] and its stable codes, and how a failed etcd call is classified (`Fail`):
//! ambiguous (retry, on another member), a definite refusal, or "lease not found".

use std::fmt;

use leasehold::BrokerError;

/// What went wrong with etcd, with a stable [`code`](EtcdError::code).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EtcdErrorKind {
    /// `ETCD_INVALID_CONFIG`: the [`EtcdConfig`](crate::EtcdConfig) was refused before any call.
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
    /// `ETCD_LEASE_LOST`: the etcd lease behind a held slot expired, or could not be renewed in
    /// time, under its holder.
    LeaseLost,
    /// `ETCD_INVALID_RESPONSE`: etcd answered something that makes no sense (a key of this
    /// broker changed by someone else).
    InvalidResponse,
    /// `ETCD_TLS_FAILED`: a certificate was refused (the server's by this client, or this
    /// client's, or its absence, by the server).
    Tls,
    /// `ETCD_SESSION_EXPIRED`: the broker's etcd session (the lease its queue places and slots
    /// are kept under) expired, as etcd itself says, while an acquire waited: the waiter lost
    /// its place. Only an expiry confirmed by etcd ends a wait; an outage or a leader election
    /// does not.
    SessionExpired,
    /// `ETCD_POOL_NESTED`: the pool's keys would lie inside another pool's (or another pool's
    /// inside this one's): refused at `connect`, before anything is written.
    NestedPool,
    /// `ETCD_BROKER_CLOSED`: the broker was closed ([`SlotBroker::close`](leasehold::SlotBroker::close)):
    /// it grants nothing more.
    Closed,
    /// `ETCD_REQUEST_SETTLING`: an acquire reused the request id of a grant whose release is
    /// still being finished in the background: its grant is being handed on, never handed out
    /// again. Use a fresh request id, or retry once the release has settled.
    RequestSettling,
}

/// A failure of the etcd broker. Never contains credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdError {
    kind: EtcdErrorKind,
    pub(super) message: String,
}

impl EtcdError {
    pub(super) fn new(kind: EtcdErrorKind, message: impl Into<String>) -> Self {
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
            EtcdErrorKind::SessionExpired => "ETCD_SESSION_EXPIRED",
            EtcdErrorKind::NestedPool => "ETCD_POOL_NESTED",
            EtcdErrorKind::Closed => "ETCD_BROKER_CLOSED",
            EtcdErrorKind::RequestSettling => "ETCD_REQUEST_SETTLING",
        }
    }

    /// The detail.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether this refusal concerns the pool's records (the pool is unusable as it is), as
    /// opposed to the connection or the request.
    pub(super) fn is_pool_refusal(&self) -> bool {
        matches!(
            self.kind,
            EtcdErrorKind::ForeignKey
                | EtcdErrorKind::CorruptRecord
                | EtcdErrorKind::CapacityMismatch
                | EtcdErrorKind::InvalidResponse
                | EtcdErrorKind::NestedPool
        )
    }

    pub(super) fn into_broker(self) -> BrokerError {
        let code = self.code();
        let err = match self.kind {
            EtcdErrorKind::Unavailable | EtcdErrorKind::SessionExpired | EtcdErrorKind::Closed => {
                BrokerError::unavailable(self.message)
            }
            EtcdErrorKind::Auth
            | EtcdErrorKind::Tls
            | EtcdErrorKind::InvalidConfig
            | EtcdErrorKind::LeaseLost
            | EtcdErrorKind::RequestSettling => BrokerError::new(self.message),
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

/// How one etcd call failed, once classified.
#[derive(Debug)]
pub(super) enum Fail {
    /// No answer, or a transient refusal (no leader, member down): the effect may or may not
    /// have happened, and another member may answer.
    Ambiguous(String),
    /// etcd said the lease does not exist (expired or revoked).
    NotFound,
    /// A definite refusal.
    Fatal(EtcdError),
}

impl Fail {
    pub(super) fn into_etcd(self, what: &str) -> EtcdError {
        match self {
            Fail::Ambiguous(m) => {
                EtcdError::new(EtcdErrorKind::Unavailable, format!("{what}: {m}"))
            }
            Fail::NotFound => EtcdError::new(
                EtcdErrorKind::SessionExpired,
                format!("{what}: the broker's etcd session no longer exists (expired or revoked)"),
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

pub(super) fn classify(err: etcd_client::Error) -> Fail {
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
                // Internal (an HTTP/2 stream reset when etcd dies mid-call), Unavailable (no
                // leader, leader changed, connection refused).
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
        // The client's keep-alive reads the first answer: a TTL of 0 means the lease is gone,
        // for certain.
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
