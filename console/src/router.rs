//! The HTTP side: the routes, the guards every request and every action passes, and the
//! handlers. Every refusal is an [`ApiError`] with a stable code and changes nothing.
//!
//! Order of the checks for an action, each refusing before the next is looked at: the route's
//! method (405), the `Host` (403, for every route), another site (403), actions turned on
//! (403), the token (403), the content type (415), the body's size (413), the body itself
//! (400). The token is checked before the body is read, so a caller without it learns nothing
//! about what a valid body looks like.

use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use subtle::ConstantTimeEq;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::error::{ApiError, codes};
use super::{ActionsToken, BODY_TIMEOUT, MAX_ACTION_BODY, MAX_RESIZE_SLOTS, MAX_STREAMS};
use leasehold::{JobSpec, LeasePhase, Supervisor};

const INDEX_HTML: &str = include_str!("assets/index.html");
const CONSOLE_JS: &str = include_str!("assets/console.js");
const CONSOLE_CSS: &str = include_str!("assets/console.css");

/// No script, style, image or connection from anywhere but the console itself; never framed.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                   connect-src 'self'; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

/// What every handler shares.
pub(crate) struct App {
    pub(crate) sup: Supervisor,
    pub(crate) frames: watch::Receiver<Arc<str>>,
    /// The per-slot timeline, about once a second.
    pub(crate) timeline: watch::Receiver<Arc<str>>,
    /// The history of job ends.
    pub(crate) outcomes: crate::Outcomes,
    /// The waiting callers last listed (for the queue's search).
    pub(crate) waiters: crate::sampler::Waiters,
    pub(crate) token: Option<ActionsToken>,
    /// Host names (lowercase) answered to besides IP literals and `localhost`.
    pub(crate) allowed_hosts: Vec<String>,
    pub(crate) streams: AtomicUsize,
    pub(crate) stop: CancellationToken,
}

pub(crate) fn router(app: Arc<App>) -> Router {
    let only = |allow: &'static str| move || async move { ApiError::method_not_allowed(allow) };
    let routes = Router::new()
        .route("/", get(index).fallback(only("GET, HEAD")))
        .route("/console.js", get(script).fallback(only("GET, HEAD")))
        .route("/console.css", get(style).fallback(only("GET, HEAD")))
        .route("/favicon.ico", get(no_icon).fallback(only("GET, HEAD")))
        .route("/api/snapshot", get(snapshot).fallback(only("GET, HEAD")))
        .route("/api/timeline", get(timeline).fallback(only("GET, HEAD")))
        .route("/api/history", get(history).fallback(only("GET, HEAD")))
        .route("/api/queue", get(queue).fallback(only("GET, HEAD")))
        .route("/api/events", get(events).fallback(only("GET")))
        .route("/api/actions/cancel", post(cancel).fallback(only("POST")))
        .route("/api/actions/reclaim", post(reclaim).fallback(only("POST")))
        .route("/api/actions/resize", post(resize).fallback(only("POST")))
        .fallback(|| async { ApiError::not_found("no such page or route") })
        .with_state(Arc::clone(&app));
    // The host guard and the security headers wrap the routing, not each route: a refusal is
    // never dressed as a route's answer (no `Allow` of a route the request never reached), and
    // every response, refusals included, carries the same headers.
    Router::new()
        .fallback_service(routes)
        .layer(middleware::from_fn_with_state(app, host_guard))
        .layer(middleware::map_response(with_security_headers))
}

async fn with_security_headers(mut response: Response) -> Response {
    security_headers(response.headers_mut());
    response
}

/// The page has no icon: `204 No Content` instead of a 404 in the browser's console.
async fn no_icon() -> StatusCode {
    StatusCode::NO_CONTENT
}

/// Refuses a request whose `Host` is not an IP literal, `localhost` or a name the embedder
/// allowed: a page on another site that rebinds its own name to this address sends its own
/// name as `Host`, and would otherwise read the console as if it were same-origin.
async fn host_guard(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok());
    match host {
        Some(host) if host_allowed(host, &app.allowed_hosts) => next.run(request).await,
        _ => ApiError::forbidden(
            codes::CONSOLE_HOST_REFUSED,
            "this console answers only to an IP address, localhost, or the host names its \
             embedder allowed",
        )
        .into_response(),
    }
}

/// The host part of a `Host` header (without the port), lowercase.
fn host_name(host: &str) -> Option<String> {
    let host = host.trim();
    if let Some(rest) = host.strip_prefix('[') {
        let (v6, after) = rest.split_once(']')?;
        if !(after.is_empty() || after.strip_prefix(':').is_some_and(is_port)) {
            return None;
        }
        return Some(format!("[{}]", v6.to_ascii_lowercase()));
    }
    let name = match host.rsplit_once(':') {
        Some((name, port)) if is_port(port) => name,
        Some(_) => return None,
        None => host,
    };
    (!name.is_empty()).then(|| name.to_ascii_lowercase())
}

fn is_port(p: &str) -> bool {
    !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit())
}

pub(crate) fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let Some(name) = host_name(host) else {
        return false;
    };
    let literal = name
        .strip_prefix('[')
        .and_then(|n| n.strip_suffix(']'))
        .unwrap_or(&name);
    literal.parse::<IpAddr>().is_ok() || name == "localhost" || allowed.contains(&name)
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

fn security_headers(headers: &mut HeaderMap) {
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
}

async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", CONSOLE_JS)
}

async fn style() -> Response {
    asset("text/css; charset=utf-8", CONSOLE_CSS)
}

fn json(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// The latest frame, exactly as the event stream sends it.
async fn snapshot(State(app): State<Arc<App>>) -> Response {
    let frame = app.frames.borrow().clone();
    json(StatusCode::OK, frame.to_string())
}

/// The per-slot timeline of the last minute (refreshed about once a second).
async fn timeline(State(app): State<Arc<App>>) -> Response {
    let timeline = app.timeline.borrow().clone();
    json(StatusCode::OK, timeline.to_string())
}

/// A query's parameters: `?code=..&q=..&limit=..&before=..` (each optional).
#[derive(Deserialize)]
struct Find {
    code: Option<String>,
    #[serde(default)]
    q: String,
    limit: Option<usize>,
    /// The history's rows older than this row (`seq`): the next page.
    before: Option<u64>,
}

/// The most rows one answer lists.
const MAX_ROWS: usize = 500;

fn find(query: Result<Query<Find>, QueryRejection>) -> Result<Find, ApiError> {
    let Query(find) =
        query.map_err(|e| ApiError::bad_request(format!("a malformed query: {e}")))?;
    if find.q.len() > 128 || find.code.as_ref().is_some_and(|c| c.len() > 64) {
        return Err(ApiError::bad_request("a search is at most 128 characters"));
    }
    Ok(find)
}

/// The history of job ends, newest first: filtered by `code` (a code or an embedder's label;
/// `unreported` for an end without a code), searched by job id (`q`), the rows older than the
/// row `before` (its `seq`: the next page), at most `limit` (default and most 500). Says how
/// many rows the history holds (`total`), how many match (`matched`), and how many of those
/// are newer than this page (`newer`).
async fn history(
    State(app): State<Arc<App>>,
    query: Result<Query<Find>, QueryRejection>,
) -> Response {
    answer(query, |find, limit| {
        let code = find.code.as_deref().filter(|c| !c.is_empty());
        let page = app.outcomes.log().query(code, &find.q, find.before, limit);
        serde_json::to_value(&page).expect("a page always serializes")
    })
}

/// The waiting callers of the last listing (about once a second) that the lease table does
/// not show granted since, in the order they are served: searched by job id (`q`), at most
/// `limit` (default and most 500).
async fn queue(
    State(app): State<Arc<App>>,
    query: Result<Query<Find>, QueryRejection>,
) -> Response {
    answer(query, |find, limit| {
        let leases = app.sup.leases();
        let now = tokio::time::Instant::now();
        let (rows, listed) =
            crate::sampler::search_waiters(&app.waiters, (&leases, now), &find.q, limit);
        serde_json::json!({ "listed": listed, "rows": rows })
    })
}

/// A search's answer: its query checked (400 otherwise), its limit capped, `list` its rows.
fn answer(
    query: Result<Query<Find>, QueryRejection>,
    list: impl FnOnce(&Find, usize) -> serde_json::Value,
) -> Response {
    match find(query) {
        Ok(find) => {
            let limit = find.limit.unwrap_or(MAX_ROWS).min(MAX_ROWS);
            json(StatusCode::OK, list(&find, limit).to_string())
        }
        Err(e) => e.into_response(),
    }
}

/// Releases its place among the open streams when the stream is dropped (the browser went
/// away, or the console stopped).
struct StreamPlace(Arc<App>);

impl Drop for StreamPlace {
    fn drop(&mut self) {
        self.0.streams.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Server-sent events: the latest frame at once, then every new one (ten a second). Each
/// stream only clones the sampler's frames; it never reads the supervisor itself.
async fn events(State(app): State<Arc<App>>) -> Response {
    // Relaxed: a plain counter; a race can at most let one stream past the cap for a moment.
    if app.streams.fetch_add(1, Ordering::Relaxed) >= MAX_STREAMS {
        app.streams.fetch_sub(1, Ordering::Relaxed);
        return ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            codes::CONSOLE_TOO_MANY_STREAMS,
            format!("{MAX_STREAMS} event streams are open already"),
        )
        .into_response();
    }
    let place = StreamPlace(Arc::clone(&app));
    let state = (app.frames.clone(), app.stop.clone(), place, true);
    let stream =
        futures_util::stream::unfold(state, |(mut frames, stop, place, first)| async move {
            if stop.is_cancelled() {
                return None;
            }
            if !first {
                tokio::select! {
                    () = stop.cancelled() => return None,
                    changed = frames.changed() => changed.ok()?,
                }
            }
            let frame = frames.borrow_and_update().clone();
            let event = Event::default().data(&*frame);
            Some((Ok::<_, Infallible>(event), (frames, stop, place, false)))
        });
    let mut response = Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response();
    security_headers(response.headers_mut());
    response
}

impl App {
    /// Every check an action passes before it is performed; the parsed body.
    async fn action<T: DeserializeOwned>(
        &self,
        headers: &HeaderMap,
        body: Body,
    ) -> Result<T, ApiError> {
        refuse_cross_site(headers)?;
        let Some(token) = &self.token else {
            return Err(ApiError::forbidden(
                codes::CONSOLE_ACTIONS_DISABLED,
                "actions are off: the embedder did not give this console an actions token",
            ));
        };
        check_token(headers, token)?;
        check_json_content_type(headers)?;
        let body = read_limited(headers, body).await?;
        let bad = |e: serde_json::Error| {
            ApiError::bad_request(format!("the body is not a valid action: {e}"))
        };
        // An object, and only an object (serde would take `[]` for a struct without fields),
        // with no key twice.
        let object = serde_json::from_slice::<crate::json::UniqueObject>(&body).map_err(bad)?;
        T::deserialize(serde_json::Value::Object(object.0)).map_err(bad)
    }
}

/// Refuses a request another site made: an `Origin` other than this console's own, by `http`
/// or `https` (the browser sends it with every `POST`), or `Sec-Fetch-Site` other than
/// `same-origin`.
/// Requests with neither (a command-line client) pass on to the token check.
fn refuse_cross_site(headers: &HeaderMap) -> Result<(), ApiError> {
    let cross = |why: String| Err(ApiError::forbidden(codes::CONSOLE_CROSS_SITE, why));
    if let Some(site) = headers.get("sec-fetch-site")
        && site.as_bytes() != b"same-origin"
    {
        return cross(format!(
            "actions are taken only from the console's own page (Sec-Fetch-Site: {})",
            String::from_utf8_lossy(site.as_bytes())
        ));
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or_default();
        // `https` too: the console behind a TLS-terminating proxy sees its page's origin so.
        let same = origin.to_str().is_ok_and(|o| {
            !host.is_empty()
                && [format!("http://{host}"), format!("https://{host}")]
                    .iter()
                    .any(|own| o.eq_ignore_ascii_case(own))
        });
        if !same {
            return cross(format!(
                "actions are taken only from the console's own page (Origin: {})",
                String::from_utf8_lossy(origin.as_bytes())
            ));
        }
    }
    Ok(())
}

/// `Authorization: Bearer <token>`, compared in constant time. A token anywhere else (a
/// cookie, the query string, the body) is not looked at.
fn check_token(headers: &HeaderMap, token: &ActionsToken) -> Result<(), ApiError> {
    let given = headers
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes)
        .and_then(|v| {
            let (scheme, rest) = v.split_at_checked(7)?;
            scheme.eq_ignore_ascii_case(b"bearer ").then_some(rest)
        });
    // `ct_eq` on slices returns at once for different lengths (the length is not the secret:
    // it is at least MIN_TOKEN_LEN); for equal lengths it looks at every byte.
    match given {
        Some(given) if bool::from(given.ct_eq(token.secret.as_bytes())) => Ok(()),
        // The same code either way (nothing changed); the words say which it was.
        Some(_) => Err(ApiError::forbidden(
            codes::CONSOLE_FORBIDDEN,
            "the token is wrong: it is not this console's actions token",
        )),
        None => Err(ApiError::forbidden(
            codes::CONSOLE_FORBIDDEN,
            "no token: this action needs the console's token in an `Authorization: Bearer` \
             header",
        )),
    }
}

fn check_json_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"));
    if json {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            codes::CONSOLE_UNSUPPORTED_MEDIA_TYPE,
            "an action's body is JSON: send Content-Type: application/json",
        ))
    }
}

async fn read_limited(headers: &HeaderMap, body: Body) -> Result<axum::body::Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            codes::CONSOLE_PAYLOAD_TOO_LARGE,
            format!("an action's body is at most {MAX_ACTION_BODY} bytes"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_ACTION_BODY as u64) {
        return Err(too_large());
    }
    // A body without a length (chunked) is cut off at the limit. The only other read error
    // is a client that went away, which hears no answer anyway. A body that stalls is given
    // up at BODY_TIMEOUT, so that it holds neither a task nor the console's shutdown.
    match tokio::time::timeout(BODY_TIMEOUT, axum::body::to_bytes(body, MAX_ACTION_BODY)).await {
        Ok(read) => read.map_err(|_| too_large()),
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            codes::CONSOLE_REQUEST_TIMEOUT,
            format!("the body did not arrive within {BODY_TIMEOUT:?}"),
        )),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelBody {
    job_id: String,
    /// The lease the user confirmed the cancel of: refused when it is no longer that job's.
    #[serde(default)]
    lease_id: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReclaimBody {
    /// The quarantined leases the user confirmed: refused when another one is quarantined.
    #[serde(default)]
    lease_ids: Option<Vec<u64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResizeBody {
    slots: u32,
    /// The capacity the user saw when confirming: refused when it is another now.
    #[serde(default)]
    from: Option<u32>,
}

/// `POST /api/actions/cancel` `{"job_id": "..", "lease_id": n}`: [`Supervisor::cancel`]. With
/// a `lease_id` (the page always sends the one the user confirmed), the cancel is refused with
/// `CONSOLE_TARGET_CHANGED` when that lease is not the job's running or draining lease any more,
/// and with `CONSOLE_TARGET_AMBIGUOUS` when the job id also names another caller (leasehold
/// cancels by job id: the cancel would reach it too). 404 when no job of that id waits or runs.
///
/// The check reads the lease table and the cancel follows it at once; leasehold's public API
/// cancels by job id, so a second run of the same id granted a slot in between would be
/// cancelled too.
async fn cancel(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let CancelBody { job_id, lease_id } = app.action(&headers, body).await?;
    // The same boundary check a job's id passes, so that no id the supervisor would refuse is
    // sent to it.
    if let Err(e) = JobSpec::new(job_id.as_str()) {
        return Err(ApiError::bad_request(format!("not a job id: {e}")).with_cause(e.code()));
    }
    if let Some(lease_id) = lease_id {
        confirmed_lease(&app, &job_id, lease_id)?;
    }
    let found = app
        .sup
        .cancel(&job_id)
        .await
        .map_err(|e| ApiError::from_supervisor(e.code(), &e))?;
    if !found {
        return Err(ApiError::not_found(format!(
            "no job `{job_id}` waits for a slot or holds one"
        )));
    }
    // A request: the job ends in its own time (its outcome says how).
    let body = serde_json::json!({
        "ok": true,
        "job_id": job_id,
        "lease_id": lease_id,
        "cancel_requested": true,
    });
    Ok(json(StatusCode::OK, body.to_string()))
}

/// Whether `lease_id` is `job_id`'s running or draining lease now, and the only caller that
/// job id names (no other lease of it in the table, none of it still waiting in the last
/// listing).
fn confirmed_lease(app: &App, job_id: &str, lease_id: u64) -> Result<(), ApiError> {
    let leases = app.sup.leases();
    let now = tokio::time::Instant::now();
    let changed = |why: String| {
        ApiError::conflict(
            codes::CONSOLE_TARGET_CHANGED,
            format!("nothing was cancelled: {why}"),
        )
    };
    let Some(lease) = leases
        .iter()
        .find(|l| l.tokens.first().is_some_and(|t| t.lease_id() == lease_id))
    else {
        return Err(changed(format!(
            "lease {lease_id} has ended: it is no longer `{job_id}`'s"
        )));
    };
    if lease.job_id.as_deref() != Some(job_id) {
        let holder = lease.job_id.as_deref().unwrap_or("an explicit lease");
        return Err(changed(format!(
            "lease {lease_id} is `{holder}`'s, not `{job_id}`'s"
        )));
    }
    if !matches!(lease.phase, LeasePhase::Running | LeasePhase::Draining) {
        return Err(changed(format!(
            "the release of `{job_id}`'s lease {lease_id} has begun: a cancel no longer reaches \
             it"
        )));
    }
    let ambiguous = |what: &str| {
        ApiError::conflict(
            codes::CONSOLE_TARGET_AMBIGUOUS,
            format!(
                "nothing was cancelled: the job id `{job_id}` also names {what}, and a cancel by \
                 job id would reach it too"
            ),
        )
    };
    if let Some(other) = leases.iter().find(|l| {
        l.job_id.as_deref() == Some(job_id)
            && l.tokens.first().is_some_and(|t| t.lease_id() != lease_id)
    }) {
        let other = other.tokens.first().map_or(0, |t| t.lease_id());
        return Err(ambiguous(&format!("lease {other}")));
    }
    let waiting = app
        .waiters
        .lock()
        .still_waiting(&leases, now)
        .any(|w| w.job_id.as_deref() == Some(job_id));
    if waiting {
        return Err(ambiguous("a caller waiting for a slot"));
    }
    Ok(())
}

/// `POST /api/actions/reclaim` `{"lease_ids": [..]}`: [`Supervisor::reclaim_quarantined`].
/// With `lease_ids` (the page sends those the user confirmed), refused with
/// `CONSOLE_TARGET_CHANGED` when a lease not named is quarantined now (the reclaim would check
/// it too); `{}` reclaims whatever is quarantined.
///
/// The check asks the supervisor for its quarantined slots and the reclaim follows at once;
/// leasehold's reclaim takes no list, so a slot quarantined in between is checked too (a
/// reclaim only ever releases a slot it finds clean).
async fn reclaim(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let ReclaimBody { lease_ids } = app.action(&headers, body).await?;
    if let Some(confirmed) = lease_ids {
        let now = app
            .sup
            .quarantined()
            .await
            .map_err(|e| ApiError::from_supervisor(e.code(), &e))?;
        if let Some(other) = now
            .iter()
            .find(|q| !confirmed.contains(&q.token.lease_id()))
        {
            return Err(ApiError::conflict(
                codes::CONSOLE_TARGET_CHANGED,
                format!(
                    "nothing was reclaimed: slot {} (lease {}) is quarantined too, and was not \
                     among the slots confirmed",
                    other.token.slot_id(),
                    other.token.lease_id()
                ),
            ));
        }
    }
    let report = app
        .sup
        .reclaim_quarantined()
        .await
        .map_err(|e| ApiError::from_supervisor(e.code(), &e))?;
    let reclaimed: Vec<_> = report
        .reclaimed
        .iter()
        .map(|t| serde_json::json!({ "slot": t.slot_id(), "lease_id": t.lease_id() }))
        .collect();
    let still: Vec<_> = report
        .still_quarantined
        .iter()
        .map(|q| {
            serde_json::json!({
                "slot": q.token.slot_id(),
                "lease_id": q.token.lease_id(),
                "job_id": q.job_id,
                "reason": q.reason,
            })
        })
        .collect();
    let body =
        serde_json::json!({ "ok": true, "reclaimed": reclaimed, "still_quarantined": still });
    Ok(json(StatusCode::OK, body.to_string()))
}

/// `POST /api/actions/resize` `{"slots": n, "from": m}`: [`Supervisor::resize`], for `n` in
/// `1..=MAX_RESIZE_SLOTS`. With `from` (the page sends the capacity the user saw), refused with
/// `CONSOLE_TARGET_CHANGED` when the capacity is another now.
async fn resize(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let ResizeBody { slots, from } = app.action(&headers, body).await?;
    if slots > MAX_RESIZE_SLOTS {
        return Err(ApiError::bad_request(format!(
            "the console resizes to at most {MAX_RESIZE_SLOTS} slots"
        )));
    }
    if let Some(from) = from {
        let now = app.sup.stats().capacity;
        if now != Some(from as usize) {
            let now = now.map_or_else(|| "unknown".to_owned(), |c| c.to_string());
            return Err(ApiError::conflict(
                codes::CONSOLE_TARGET_CHANGED,
                format!("nothing was resized: the capacity is {now} now, not the {from} confirmed"),
            ));
        }
    }
    let capacity = app
        .sup
        .resize(slots)
        .await
        .map_err(|e| ApiError::from_supervisor(e.code(), &e))?;
    let body = serde_json::json!({ "ok": true, "capacity": capacity });
    Ok(json(StatusCode::OK, body.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_answered_to_are_ip_literals_localhost_and_the_allowed_names() {
        let allowed = vec!["farm.internal".to_owned()];
        for ok in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "[::1]:9",
            "[::1]",
            "LocalHost:80",
            "10.1.2.3:7000",
            "farm.internal:7000",
        ] {
            assert!(host_allowed(ok, &allowed), "{ok}");
        }
        for refused in [
            "",
            "evil.example:8080",
            "127.0.0.1.evil.example",
            "localhost.evil.example:80",
            "[::1]x:80",
            "127.0.0.1:port",
            ":80",
        ] {
            assert!(!host_allowed(refused, &allowed), "{refused}");
        }
    }
}
