//! `EtcdBroker` over TLS against a real etcd serving https on loopback with client-certificate
//! auth (`--client-cert-auth`): certificates are generated in-process (a CA, a server
//! certificate for `localhost` and 127.0.0.1, a client certificate), written to a temp dir and
//! handed to etcd; the broker connects with `EtcdConfig::tls`.
//!
//! Needs the `tls` feature (`cargo test -p leasehold-etcd --features tls --test etcd_tls`) and an etcd
//! binary; without the binary each test says SKIPPED, and with `LEASEHOLD_REQUIRE_ETCD=1` it
//! fails instead.
#![cfg(feature = "tls")]

mod etcd_support;

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use etcd_client::{Certificate, Client, ConnectOptions, GetOptions, Identity, TlsOptions};
use etcd_support::{Etcd, EtcdWith, etcd_binary};
use leasehold::{AcquireRequest, JobSpec, SlotBroker, Supervisor};
use leasehold_etcd::{EtcdBroker, EtcdConfig};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use tempfile::TempDir;

/// The connect bounds of the refused connections.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const RETRY_FOR: Duration = Duration::from_secs(2);
/// How long a refused connect may take: the connect bound, plus one call bound (2 s by default)
/// for the attempt in flight when it runs out, plus slack for a loaded machine.
const REFUSAL_BOUND: Duration = Duration::from_secs(7);
/// Guards against a refused connect that hangs (reported as such, not as a test timeout).
const HANG_GUARD: Duration = Duration::from_secs(30);

/// A certificate authority: its PEM certificate and what signs with it.
struct Ca {
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("generate CA key");
        let cert = params.self_signed(&key).expect("self-sign CA");
        Ca {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A leaf certificate signed by this CA: (certificate PEM, private key PEM).
    fn sign(
        &self,
        common_name: &str,
        alt_names: &[&str],
        usages: &[ExtendedKeyUsagePurpose],
    ) -> (String, String) {
        let alt_names: Vec<String> = alt_names.iter().map(|s| (*s).to_owned()).collect();
        let mut params = CertificateParams::new(alt_names).expect("leaf params");
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = usages.to_vec();
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate().expect("generate leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign leaf");
        (cert.pem(), key.serialize_pem())
    }
}

/// Everything a test needs: etcd serving https with client-certificate auth, the CA that signed
/// its certificate, and a client certificate signed by that CA.
struct TlsEtcd {
    etcd: EtcdWith,
    ca_pem: String,
    client_cert_pem: String,
    client_key_pem: String,
    /// Holds the certificate files etcd reads; removed on drop (after etcd is killed).
    _certs: TempDir,
}

impl TlsEtcd {
    fn start(bin: &Path) -> TlsEtcd {
        let ca = Ca::new("leasehold test CA");
        let (server_cert, server_key) = ca.sign(
            "localhost",
            &["localhost", "127.0.0.1"],
            // etcd also dials itself (its grpc-gateway) with its server certificate, which
            // `--client-cert-auth` then checks as a client certificate.
            &[
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        );
        let (client_cert_pem, client_key_pem) = ca.sign(
            "leasehold-client",
            &[],
            &[ExtendedKeyUsagePurpose::ClientAuth],
        );
        let certs = tempfile::Builder::new()
            .prefix("leasehold-etcd-tls-")
            .tempdir()
            .expect("create cert dir");
        let write = |name: &str, pem: &str| {
            let path = certs.path().join(name);
            fs::write(&path, pem).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
            path.to_str().expect("utf-8 temp path").to_owned()
        };
        let args = vec![
            "--cert-file".to_owned(),
            write("server.pem", &server_cert),
            "--key-file".to_owned(),
            write("server-key.pem", &server_key),
            "--trusted-ca-file".to_owned(),
            write("ca.pem", &ca.cert_pem),
            "--client-cert-auth".to_owned(),
        ];
        let etcd = Etcd::start_with(bin, "https", &args);
        assert!(etcd.endpoint().starts_with("https://127.0.0.1:"));
        TlsEtcd {
            etcd,
            ca_pem: ca.cert_pem,
            client_cert_pem,
            client_key_pem,
            _certs: certs,
        }
    }

    /// Trusts the etcd CA, presents the client certificate, expects `localhost`.
    fn good_tls(&self) -> TlsOptions {
        TlsOptions::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(Identity::from_pem(
                &self.client_cert_pem,
                &self.client_key_pem,
            ))
            .domain_name("localhost")
    }

    fn config(&self, pool: &str, capacity: u32, tls: TlsOptions) -> EtcdConfig {
        EtcdConfig::new([self.etcd.endpoint()], pool, capacity)
            .ttl(Duration::from_secs(2))
            .tls(tls)
    }

    /// A config whose connect must be refused, bounded in time.
    fn refused_config(&self, tls: TlsOptions) -> EtcdConfig {
        self.config("tls", 2, tls)
            .connect_timeout(CONNECT_TIMEOUT)
            .retry_for(RETRY_FOR)
    }

    /// A plain etcd client over TLS, to look at the keys independently of the broker.
    async fn client(&self) -> Client {
        Client::connect(
            [self.etcd.endpoint()],
            Some(ConnectOptions::new().with_tls(self.good_tls())),
        )
        .await
        .expect("etcd client over TLS")
    }
}

/// Slot keys held right now in `pool`, read straight from etcd: (key, lease).
async fn slot_keys(c: &mut Client, pool: &str) -> Vec<(String, i64)> {
    let resp = c
        .get(
            format!("leasehold/{pool}/slot/"),
            Some(GetOptions::new().with_prefix()),
        )
        .await
        .expect("read slot keys over TLS");
    resp.kvs()
        .iter()
        .map(|kv| (kv.key_str().unwrap().to_owned(), kv.lease()))
        .collect()
}

/// Connects with `config`, which must fail within `REFUSAL_BOUND`; returns the error.
async fn connect_refused(config: EtcdConfig) -> leasehold_etcd::EtcdError {
    let started = Instant::now();
    let result = tokio::time::timeout(HANG_GUARD, EtcdBroker::connect(config))
        .await
        .expect("a refused TLS connect ends");
    let elapsed = started.elapsed();
    let err = match result {
        Ok(broker) => panic!("connect succeeded but must be refused: {broker:?}"),
        Err(err) => err,
    };
    eprintln!("refused after {elapsed:?}: {err}");
    assert!(
        elapsed < REFUSAL_BOUND,
        "took {elapsed:?} (connect timeout {CONNECT_TIMEOUT:?}): {err}"
    );
    assert!(!err.message().trim().is_empty(), "empty message: {err:?}");
    err
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_with_a_client_certificate_acquires_and_releases_over_tls() {
    let Some(bin) =
        etcd_binary("a_broker_with_a_client_certificate_acquires_and_releases_over_tls")
    else {
        return;
    };
    let tls = TlsEtcd::start(&bin);
    let broker = EtcdBroker::connect(tls.config("tls", 2, tls.good_tls()))
        .await
        .unwrap_or_else(|e| panic!("connect over TLS: {e}; etcd log:\n{}", tls.etcd.log_tail()));
    assert_eq!(broker.capacity(), Some(2));
    let mut c = tls.client().await;
    assert!(slot_keys(&mut c, "tls").await.is_empty());

    let a = broker
        .acquire(AcquireRequest::new(1, Some("a")))
        .await
        .expect("first acquire over TLS");
    let b = broker
        .acquire(AcquireRequest::new(2, Some("b")))
        .await
        .expect("second acquire over TLS");
    assert_ne!(a, b);
    assert!(a.lease_id() < b.lease_id(), "fencing tokens increase");
    let held = slot_keys(&mut c, "tls").await;
    assert_eq!(held.len(), 2, "both slots are held in etcd: {held:?}");
    let key_a = format!("leasehold/tls/slot/{:06}", a.slot_id());
    assert!(
        held.contains(&(key_a, broker.etcd_lease_of(a).expect("a is held"))),
        "{held:?}"
    );

    broker.release(a).await.expect("release over TLS");
    broker.release(b).await.expect("release over TLS");
    assert!(slot_keys(&mut c, "tls").await.is_empty());
    // The slots came back: another acquire is granted.
    let again = broker
        .acquire(AcquireRequest::new(3, Some("again")))
        .await
        .expect("acquire after release");
    broker.release(again).await.expect("release over TLS");
    assert!(slot_keys(&mut c, "tls").await.is_empty());
    assert_eq!(broker.orphans_expired(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supervisor_runs_a_job_on_an_etcd_slot_over_tls() {
    let Some(bin) = etcd_binary("a_supervisor_runs_a_job_on_an_etcd_slot_over_tls") else {
        return;
    };
    let tls = TlsEtcd::start(&bin);
    let broker = EtcdBroker::connect(tls.config("tls-sup", 1, tls.good_tls()))
        .await
        .unwrap_or_else(|e| panic!("connect over TLS: {e}; etcd log:\n{}", tls.etcd.log_tail()));
    let sup = Supervisor::builder().broker(broker).start().await.unwrap();
    let endpoint = tls.etcd.endpoint();
    let options = tls.good_tls();
    let (token, held_during) = sup
        .run(JobSpec::new("tls-job").unwrap(), move |ctx| async move {
            // While the job runs, its slot key exists in etcd (read over a second TLS client).
            let mut c = Client::connect([endpoint], Some(ConnectOptions::new().with_tls(options)))
                .await
                .map_err(std::io::Error::other)?;
            let held = slot_keys(&mut c, "tls-sup").await;
            Ok::<_, std::io::Error>((ctx.token(), held))
        })
        .await
        .unwrap();
    assert_eq!(
        held_during.len(),
        1,
        "one slot held while the job runs: {held_during:?}"
    );
    assert_eq!(
        held_during[0].0,
        format!("leasehold/tls-sup/slot/{:06}", token.slot_id()),
        "the job's slot key exists while it runs"
    );
    assert!(held_during[0].1 > 0, "under an etcd lease: {held_during:?}");
    let stats = sup.stats();
    assert_eq!(stats.acquired_total, 1);
    assert_eq!(stats.released_total, 1);
    let mut c = tls.client().await;
    assert!(
        slot_keys(&mut c, "tls-sup").await.is_empty(),
        "the slot was given back after the job"
    );
    sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_without_a_client_certificate_is_refused() {
    let Some(bin) = etcd_binary("a_connect_without_a_client_certificate_is_refused") else {
        return;
    };
    let tls = TlsEtcd::start(&bin);
    let no_identity = TlsOptions::new()
        .ca_certificate(Certificate::from_pem(&tls.ca_pem))
        .domain_name("localhost");
    let err = connect_refused(tls.refused_config(no_identity)).await;
    // The server just closes the connection: the broker cannot tell, but says what it may be.
    assert_eq!(err.code(), "ETCD_UNAVAILABLE", "{err}");
    assert!(err.message().contains("client certificate"), "{err}");
    // It was the TLS client authentication that refused it (Go's crypto/tls wording).
    let log = tls.etcd.log();
    assert!(
        log.contains("client didn't provide a certificate"),
        "etcd log:\n{}",
        tls.etcd.log_tail()
    );
    // etcd itself is fine: the same endpoint with the certificate works.
    EtcdBroker::connect(tls.config("tls", 2, tls.good_tls()))
        .await
        .unwrap_or_else(|e| panic!("connect over TLS: {e}; etcd log:\n{}", tls.etcd.log_tail()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_trusting_another_ca_is_refused() {
    let Some(bin) = etcd_binary("a_connect_trusting_another_ca_is_refused") else {
        return;
    };
    let tls = TlsEtcd::start(&bin);
    let other = Ca::new("some other CA");
    let wrong_ca = TlsOptions::new()
        .ca_certificate(Certificate::from_pem(&other.cert_pem))
        .identity(Identity::from_pem(
            &tls.client_cert_pem,
            &tls.client_key_pem,
        ))
        .domain_name("localhost");
    let err = connect_refused(tls.refused_config(wrong_ca)).await;
    // A certificate refused by this client is a definite answer, reported at once.
    assert_eq!(err.code(), "ETCD_TLS_FAILED", "{err}");
    assert!(err.message().contains("UnknownIssuer"), "{err}");
    // The client refused etcd's certificate (its alert, as etcd logs it, a moment later).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !tls
        .etcd
        .log()
        .contains("tls: unknown certificate authority")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "etcd log:\n{}",
            tls.etcd.log_tail()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    EtcdBroker::connect(tls.config("tls", 2, tls.good_tls()))
        .await
        .unwrap_or_else(|e| panic!("connect over TLS: {e}; etcd log:\n{}", tls.etcd.log_tail()));
}
