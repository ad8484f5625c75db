//! [`EtcdConfig`]: where the pool lives and how the broker talks to etcd, validated before any
//! call.

use std::fmt;
use std::time::Duration;

use super::error::{EtcdError, EtcdErrorKind};
use super::layout::{MAX_CAPACITY, SECTIONS};

/// How an [`EtcdBroker`](crate::EtcdBroker) reaches etcd and which pool it serves.
///
/// The password (when set) is never printed: `Debug` shows `"<redacted>"`.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use leasehold_etcd::EtcdConfig;
///
/// let config = EtcdConfig::new(["http://127.0.0.1:2379"], "render", 3)
///     .key_prefix("studio/leasehold")
///     .ttl(Duration::from_secs(10))
///     .user("farm", "s3cret");
/// assert!(!format!("{config:?}").contains("s3cret"));
/// ```
#[derive(Clone)]
pub struct EtcdConfig {
    pub(super) endpoints: Vec<String>,
    pub(super) key_prefix: String,
    pub(super) pool: String,
    pub(super) capacity: u32,
    pub(super) ttl: Duration,
    pub(super) rpc_timeout: Duration,
    pub(super) connect_timeout: Duration,
    pub(super) retry_for: Duration,
    pub(super) user: Option<(String, String)>,
    #[cfg(feature = "tls")]
    pub(super) tls: Option<etcd_client::TlsOptions>,
}

impl EtcdConfig {
    /// A pool named `pool` of `capacity` slots on the etcd cluster at `endpoints`
    /// (`http://host:port`, or `https://` with TLS; list every member: a member that stops
    /// answering is skipped until it is healthy again). Defaults: key prefix `leasehold`, TTL
    /// 10 s, 2 s per call, 5 s to connect, 10 s of retries per step.
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
            #[cfg(feature = "tls")]
            tls: None,
        }
    }

    /// The key prefix under which pools live (default `leasehold`; no trailing `/`). Neither
    /// it nor the pool name may have a part named `capacity`, `queue`, `request` or `slot`
    /// (the names leasehold uses inside a pool), and a pool whose keys would lie inside
    /// another's (`render` under `lh` and any pool under `lh/render`) is refused at `connect`.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// The TTL of the broker's etcd session, in whole seconds, at least 2 s (default 10 s).
    /// A process that dies (or cannot reach etcd) for longer loses its slots and its waiters'
    /// places; a holder that cannot renew within it is told its lease is lost.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The bound of one etcd call (default 2 s). A call without an answer in time is retried,
    /// on another member when one is healthy.
    pub fn rpc_timeout(mut self, bound: Duration) -> Self {
        self.rpc_timeout = bound;
        self
    }

    /// The bound of the first connection (default 5 s).
    pub fn connect_timeout(mut self, bound: Duration) -> Self {
        self.connect_timeout = bound;
        self
    }

    /// How long one step of an acquire (before it has a place in the queue) or a release
    /// retries calls whose answer was lost (default 10 s). After it the call fails with
    /// [`BrokerErrorKind::DeliveryUnknown`](leasehold::BrokerErrorKind::DeliveryUnknown) or
    /// `ETCD_UNAVAILABLE`, and what it may have left is cleaned up in the background. A waiter
    /// that has its place keeps it through outages and fails only when its session expires.
    pub fn retry_for(mut self, bound: Duration) -> Self {
        self.retry_for = bound;
        self
    }

    /// Authenticates as `name` (etcd user/password auth). The password is never logged.
    pub fn user(mut self, name: impl Into<String>, password: impl Into<String>) -> Self {
        self.user = Some((name.into(), password.into()));
        self
    }

    /// TLS to etcd (feature `tls`): CA certificate, optional client identity, domain name.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls(mut self, tls: etcd_client::TlsOptions) -> Self {
        self.tls = Some(tls);
        self
    }

    pub(super) fn validate(&self) -> Result<(), EtcdError> {
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
        // A part named like a section of the layout would put this pool's keys inside another
        // pool's slot, queue or request keys (pool `slot` under `lh/render` lies in the slot
        // keys of pool `render` under `lh`). Any other nesting is refused at `connect`.
        if let Some(part) = self
            .key_prefix
            .split('/')
            .chain([self.pool.as_str()])
            .find(|part| SECTIONS.contains(part))
        {
            return bad(format!(
                "{part:?} in the pool {:?} under the key prefix {:?} is a name leasehold's layout uses inside a pool ({}): the pool's keys could lie inside another pool's",
                self.pool,
                self.key_prefix,
                SECTIONS.join(", ")
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
        #[cfg(feature = "tls")]
        d.field("tls", &self.tls.is_some());
        d.finish()
    }
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
            EtcdConfig::new(["http://127.0.0.1:1"], "slot", 3).key_prefix("lh/render"),
            EtcdConfig::new(["http://127.0.0.1:1"], "p", 3).key_prefix("lh/queue"),
            EtcdConfig::new(["http://127.0.0.1:1"], "capacity", 3),
            EtcdConfig::new(["http://127.0.0.1:1"], "p", 3).key_prefix("request"),
        ] {
            let err = bad.validate().unwrap_err();
            assert_eq!(err.code(), "ETCD_INVALID_CONFIG", "{bad:?}");
        }
    }
}
