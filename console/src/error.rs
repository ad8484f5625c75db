//! The console's errors: [`ConsoleError`] for the embedder (start, token, shutdown), and the
//! JSON refusals its HTTP API answers with, each under a stable code.

use std::fmt;
use std::io;
use std::net::SocketAddr;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// The console's stable codes: [`ConsoleError::code`] for the embedder, and the `code` of
/// every JSON error the HTTP API answers with (`{"error": {"code": .., "message": ..}}`).
pub mod codes {
    /// 403: an action without the right token (none, a wrong one, or one sent any other way
    /// than the `Authorization: Bearer` header). Nothing was changed.
    pub const CONSOLE_FORBIDDEN: &str = "CONSOLE_FORBIDDEN";
    /// 403: an action on a console whose embedder did not turn actions on. Nothing was
    /// changed.
    pub const CONSOLE_ACTIONS_DISABLED: &str = "CONSOLE_ACTIONS_DISABLED";
    /// 403: an action from another site (its `Origin` is not this console's, or
    /// `Sec-Fetch-Site` is not `same-origin`). Nothing was changed.
    pub const CONSOLE_CROSS_SITE: &str = "CONSOLE_CROSS_SITE";
    /// 403: a request whose `Host` is a name the console was not told to answer to (how a DNS
    /// rebinding attack would reach a loopback server). Nothing was read or changed.
    pub const CONSOLE_HOST_REFUSED: &str = "CONSOLE_HOST_REFUSED";
    /// 400: a malformed action body (not JSON, unknown or missing fields, a job id that is
    /// not a valid id, a slot count out of range). Nothing was changed.
    pub const CONSOLE_BAD_REQUEST: &str = "CONSOLE_BAD_REQUEST";
    /// 404: no such page or API route, or no job of that id waits or runs.
    pub const CONSOLE_NOT_FOUND: &str = "CONSOLE_NOT_FOUND";
    /// 405: a method the route does not take (actions are `POST` only; pages, the snapshot and
    /// the event stream are `GET` only). Nothing was changed.
    pub const CONSOLE_METHOD_NOT_ALLOWED: &str = "CONSOLE_METHOD_NOT_ALLOWED";
    /// 413: an action body over [`MAX_ACTION_BODY`](crate::MAX_ACTION_BODY) bytes. Nothing was
    /// changed.
    pub const CONSOLE_PAYLOAD_TOO_LARGE: &str = "CONSOLE_PAYLOAD_TOO_LARGE";
    /// 408: an action body not received within
    /// [`BODY_TIMEOUT`](crate::BODY_TIMEOUT). Nothing was changed.
    pub const CONSOLE_REQUEST_TIMEOUT: &str = "CONSOLE_REQUEST_TIMEOUT";
    /// 415: an action whose `Content-Type` is not `application/json`. Nothing was changed.
    pub const CONSOLE_UNSUPPORTED_MEDIA_TYPE: &str = "CONSOLE_UNSUPPORTED_MEDIA_TYPE";
    /// 409: what the user confirmed is not what the action would act on now, and nothing was
    /// done: a cancel's lease is no longer that job's (it ended, or its release began), a
    /// slot the user did not confirm is quarantined now, or the capacity is not the one the
    /// user saw.
    pub const CONSOLE_TARGET_CHANGED: &str = "CONSOLE_TARGET_CHANGED";
    /// 409: a cancel of one job's lease when its job id also names another caller (a second
    /// run of the same id that holds a slot or waits): leasehold cancels by job id, so the
    /// cancel would reach both. Nothing was cancelled.
    pub const CONSOLE_TARGET_AMBIGUOUS: &str = "CONSOLE_TARGET_AMBIGUOUS";
    /// 409: the supervisor refused the action (its own code is in `cause`, e.g.
    /// `LEASE_BROKER_UNSUPPORTED` for a resize on a broker other than the in-process pool).
    pub const CONSOLE_REFUSED: &str = "CONSOLE_REFUSED";
    /// 429: [`MAX_STREAMS`](crate::MAX_STREAMS) event streams are open already.
    pub const CONSOLE_TOO_MANY_STREAMS: &str = "CONSOLE_TOO_MANY_STREAMS";
    /// 503: the supervisor has shut down (its `SUPERVISOR_STOPPED` is in `cause`).
    pub const CONSOLE_SUPERVISOR_STOPPED: &str = "CONSOLE_SUPERVISOR_STOPPED";
    /// [`ConsoleError::Bind`](super::ConsoleError::Bind): the address could not be bound.
    pub const CONSOLE_BIND_FAILED: &str = "CONSOLE_BIND_FAILED";
    /// [`ConsoleError::InvalidToken`](super::ConsoleError::InvalidToken): an actions token
    /// that is too short or not printable ASCII.
    pub const CONSOLE_TOKEN_INVALID: &str = "CONSOLE_TOKEN_INVALID";
    /// [`ConsoleError::InvalidLabel`](super::ConsoleError::InvalidLabel): a
    /// [`JobNote`](crate::JobNote) label that is empty, too long, or not made of ASCII
    /// letters, digits, `_` and `-`.
    pub const CONSOLE_LABEL_INVALID: &str = "CONSOLE_LABEL_INVALID";
    /// [`ConsoleError::Random`](super::ConsoleError::Random): the operating system's random
    /// source failed.
    pub const CONSOLE_RANDOM_FAILED: &str = "CONSOLE_RANDOM_FAILED";
    /// [`ConsoleError::Server`](super::ConsoleError::Server): the HTTP server stopped with an
    /// I/O error.
    pub const CONSOLE_SERVER_FAILED: &str = "CONSOLE_SERVER_FAILED";
    /// [`ConsoleError::ZeroTimeout`](super::ConsoleError::ZeroTimeout): a timeout of the
    /// console's limits set to zero.
    pub const CONSOLE_LIMIT_INVALID: &str = "CONSOLE_LIMIT_INVALID";
}

/// What went wrong starting, configuring or stopping a console.
#[derive(Debug)]
#[non_exhaustive]
pub enum ConsoleError {
    /// The listening address could not be bound (in use, not local, not permitted). Code
    /// `CONSOLE_BIND_FAILED`.
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        source: io::Error,
    },
    /// An actions token shorter than [`MIN_TOKEN_LEN`](super::MIN_TOKEN_LEN) bytes or with a
    /// character outside printable ASCII (it travels in an HTTP header). Code
    /// `CONSOLE_TOKEN_INVALID`.
    InvalidToken {
        /// What is wrong with it (never the token itself).
        why: &'static str,
    },
    /// A [`JobNote`](crate::JobNote) label that is empty, longer than
    /// [`MAX_LABEL_LEN`](crate::MAX_LABEL_LEN), or has a character other than an ASCII
    /// letter, a digit, `_` or `-`. Code `CONSOLE_LABEL_INVALID`.
    InvalidLabel {
        /// What is wrong with it.
        why: &'static str,
    },
    /// The operating system's random source failed
    /// ([`ActionsToken::random`](super::ActionsToken::random)). Code `CONSOLE_RANDOM_FAILED`.
    Random {
        /// The source's own message.
        message: String,
    },
    /// The HTTP server stopped with an I/O error. Code `CONSOLE_SERVER_FAILED`.
    Server {
        /// Why.
        source: io::Error,
    },
    /// A timeout of the console's limits ([`header_read_timeout`](super::ConsoleBuilder::header_read_timeout),
    /// [`write_timeout`](super::ConsoleBuilder::write_timeout)) was zero, which would close
    /// every connection at once; refused by [`start`](super::ConsoleBuilder::start). Code
    /// `CONSOLE_LIMIT_INVALID`.
    ZeroTimeout {
        /// The setting's name.
        what: &'static str,
    },
}

impl ConsoleError {
    /// The stable code: `CONSOLE_BIND_FAILED`, `CONSOLE_TOKEN_INVALID`,
    /// `CONSOLE_LABEL_INVALID`, `CONSOLE_RANDOM_FAILED`, `CONSOLE_SERVER_FAILED` or
    /// `CONSOLE_LIMIT_INVALID`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Bind { .. } => codes::CONSOLE_BIND_FAILED,
            Self::InvalidToken { .. } => codes::CONSOLE_TOKEN_INVALID,
            Self::InvalidLabel { .. } => codes::CONSOLE_LABEL_INVALID,
            Self::Random { .. } => codes::CONSOLE_RANDOM_FAILED,
            Self::Server { .. } => codes::CONSOLE_SERVER_FAILED,
            Self::ZeroTimeout { .. } => codes::CONSOLE_LIMIT_INVALID,
        }
    }
}

impl fmt::Display for ConsoleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Bind { addr, .. } => write!(f, "the console could not listen on {addr}"),
            Self::InvalidToken { why } => write!(f, "invalid console actions token: {why}"),
            Self::InvalidLabel { why } => write!(f, "invalid job label: {why}"),
            Self::Random { message } => write!(f, "no secure random bytes: {message}"),
            Self::Server { .. } => f.write_str("the console's HTTP server failed"),
            Self::ZeroTimeout { what } => write!(f, "the console's {what} must be positive"),
        }
    }
}

impl std::error::Error for ConsoleError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Bind { source, .. } | Self::Server { source } => Some(source),
            Self::InvalidToken { .. }
            | Self::InvalidLabel { .. }
            | Self::Random { .. }
            | Self::ZeroTimeout { .. } => None,
        }
    }
}

const _: fn() = || {
    fn assert<T: Send + Sync + 'static + std::error::Error>() {}
    assert::<ConsoleError>();
};

/// A refusal (or a failure) of the HTTP API: a status, a stable code, a message, and for a
/// supervisor's refusal its own code as `cause`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) code: &'static str,
    pub(crate) message: String,
    pub(crate) cause: Option<String>,
    /// For a 405: the methods the route takes.
    pub(crate) allow: Option<&'static str>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            cause: None,
            allow: None,
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, codes::CONSOLE_BAD_REQUEST, message)
    }

    pub(crate) fn forbidden(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, code, message)
    }

    pub(crate) fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, code, message)
    }

    pub(crate) fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, codes::CONSOLE_NOT_FOUND, message)
    }

    pub(crate) fn method_not_allowed(allow: &'static str) -> Self {
        Self {
            allow: Some(allow),
            ..Self::new(
                StatusCode::METHOD_NOT_ALLOWED,
                codes::CONSOLE_METHOD_NOT_ALLOWED,
                format!("this route takes {allow} only"),
            )
        }
    }

    pub(crate) fn with_cause(mut self, cause: impl Into<String>) -> Self {
        self.cause = Some(cause.into());
        self
    }

    /// A supervisor's refusal, through its stable code only (so that a renamed or re-typed
    /// supervisor error maps the same way).
    pub(crate) fn from_supervisor(code: &str, message: impl fmt::Display) -> Self {
        let message = message.to_string();
        let err = match code {
            "SUPERVISOR_STOPPED" => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                codes::CONSOLE_SUPERVISOR_STOPPED,
                message,
            ),
            "LEASE_SLOT_COUNT_INVALID" => Self::bad_request(message),
            _ => Self::new(StatusCode::CONFLICT, codes::CONSOLE_REFUSED, message),
        };
        err.with_cause(code)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut error = serde_json::json!({
            "code": self.code,
            "message": self.message,
        });
        if let Some(cause) = self.cause {
            error["cause"] = serde_json::Value::String(cause);
        }
        let body = serde_json::json!({ "error": error }).to_string();
        let mut response = (self.status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(allow) = self.allow {
            headers.insert(header::ALLOW, HeaderValue::from_static(allow));
        }
        response
    }
}
