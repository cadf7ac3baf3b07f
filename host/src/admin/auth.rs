//! Who may use the admin API: the bearer token check and the rule that
//! anything but a read needs it.
//!
//! Owns: [`AccessPolicy`] (what the config allows) and the two middlewares
//! the router wraps its tiers in. The routes themselves are in the parent
//! module; config validation (a token is required off loopback) is in
//! `config::validate`.

use axum::Json;
use axum::extract::Request;
use axum::http::{Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::config::Secret;

/// The admin API's access rules, from `[admin]`.
#[derive(Clone, Debug, Default)]
pub struct AccessPolicy {
    /// The bearer token, when one is configured.
    pub token: Option<Secret>,
}

impl AccessPolicy {
    /// Whether `request` carries the configured token as a bearer
    /// credential. False when no token is configured.
    fn presents_token(&self, request: &Request) -> bool {
        let Some(token) = &self.token else {
            return false;
        };
        let presented = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(bearer_credential)
            .unwrap_or("");
        tokens_match(presented, token.expose())
    }
}

/// The credential of an `Authorization: Bearer <credential>` value (the
/// scheme is case-insensitive, RFC 9110 §11.1).
fn bearer_credential(value: &str) -> Option<&str> {
    let (scheme, credential) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| credential.trim())
}

/// Compares two tokens in time that depends on neither their contents nor
/// their lengths: both are hashed first, and the digests (always 32 bytes)
/// are compared without an early exit.
fn tokens_match(presented: &str, expected: &str) -> bool {
    let a = Sha256::digest(presented.as_bytes());
    let b = Sha256::digest(expected.as_bytes());
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

/// Reads (`GET`, `HEAD`): let through when no token is configured or the
/// request carries it; 401 otherwise.
pub(super) async fn require_token_if_set(
    policy: AccessPolicy,
    request: Request,
    next: Next,
) -> Response {
    if policy.token.is_none() || policy.presents_token(&request) {
        return next.run(request).await;
    }
    unauthorized()
}

/// Everything that is not a read may change state: it needs the token
/// whatever the listen address, and with no token configured it is
/// refused outright (403). Applied to the whole router, so a route added
/// later for another method is behind the token without anyone
/// remembering to put it there.
pub(super) async fn require_token_for_changes(
    policy: AccessPolicy,
    request: Request,
    next: Next,
) -> Response {
    if matches!(*request.method(), Method::GET | Method::HEAD) || policy.presents_token(&request) {
        return next.run(request).await;
    }
    if policy.token.is_some() {
        return unauthorized();
    }
    (
        StatusCode::FORBIDDEN,
        Json(json!({
            "error": "requests other than GET and HEAD need `admin.token` to be configured \
                      and sent as `Authorization: Bearer <admin.token>`"
        })),
    )
        .into_response()
}

fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        Json(json!({"error": "this endpoint needs `Authorization: Bearer <admin.token>`"})),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_match_only_when_equal() {
        assert!(tokens_match("s3cret-token", "s3cret-token"));
        assert!(!tokens_match("s3cret-tokeN", "s3cret-token"));
        assert!(!tokens_match("s3cret", "s3cret-token"));
        assert!(!tokens_match("", "s3cret-token"));
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive_and_others_are_not_bearer() {
        assert_eq!(bearer_credential("Bearer abc"), Some("abc"));
        assert_eq!(bearer_credential("bearer abc"), Some("abc"));
        assert_eq!(bearer_credential("BEARER  abc "), Some("abc"));
        assert_eq!(bearer_credential("Basic abc"), None);
        assert_eq!(bearer_credential("Bearer"), None);
    }
}
