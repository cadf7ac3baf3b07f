//! [`Token`]: the credential a client sends in its `Hello`, and where it
//! comes from: a fixed string, a file read again for every connection
//! attempt (so a sidecar can refresh an expiring token in place), or a
//! function the process supplies.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A function that returns the current token, or why there is none.
type TokenFn = dyn Fn() -> Result<String, String> + Send + Sync;

/// Where the client's token comes from. It is read for every connection
/// attempt, never printed (`Debug` shows only its source).
#[derive(Clone)]
pub struct Token(Source);

#[derive(Clone)]
enum Source {
    Fixed(String),
    File(PathBuf),
    Function(Arc<TokenFn>),
}

impl Token {
    /// A fixed token (a JWT from `wasmrelay token issue` or your issuer).
    pub fn new(token: impl Into<String>) -> Token {
        Token(Source::Fixed(token.into()))
    }

    /// A token read from `path` for every connection attempt; surrounding
    /// whitespace is ignored. Replace the file to refresh the token.
    pub fn from_file(path: impl AsRef<Path>) -> Token {
        Token(Source::File(path.as_ref().to_path_buf()))
    }

    /// A token returned by `token` for every connection attempt (keep it
    /// quick: it runs on the client's task). An `Err` is reported as the
    /// reason the attempt was not made.
    pub fn from_fn<F>(token: F) -> Token
    where
        F: Fn() -> Result<String, String> + Send + Sync + 'static,
    {
        Token(Source::Function(Arc::new(token)))
    }

    /// The token to send now.
    pub(crate) async fn current(&self) -> Result<String, String> {
        let token = match &self.0 {
            Source::Fixed(token) => token.clone(),
            Source::File(path) => tokio::fs::read_to_string(path)
                .await
                .map_err(|e| format!("reading the token file {}: {e}", path.display()))?
                .trim()
                .to_string(),
            Source::Function(token) => token().map_err(|e| format!("getting the token: {e}"))?,
        };
        if token.trim().is_empty() {
            return Err(match &self.0 {
                Source::File(path) => format!("the token file {} is empty", path.display()),
                _ => "the token is empty".to_string(),
            });
        }
        Ok(token)
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Source::Fixed(_) => f.write_str("Token(***)"),
            Source::File(path) => write!(f, "Token(file {})", path.display()),
            Source::Function(_) => f.write_str("Token(function)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_source_gives_the_current_token_and_debug_hides_it() {
        let fixed = Token::new("abc.def.ghi");
        assert_eq!(fixed.current().await.unwrap(), "abc.def.ghi");
        assert_eq!(format!("{fixed:?}"), "Token(***)");

        let dir =
            std::env::temp_dir().join(format!("wasmrelay-client-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "first.token.x\n").unwrap();
        let file = Token::from_file(&path);
        assert_eq!(file.current().await.unwrap(), "first.token.x");
        std::fs::write(&path, "second.token.x").unwrap();
        assert_eq!(file.current().await.unwrap(), "second.token.x");
        std::fs::write(&path, "\n").unwrap();
        assert!(file.current().await.unwrap_err().contains("is empty"));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            file.current()
                .await
                .unwrap_err()
                .contains("reading the token file")
        );

        let function = Token::from_fn(|| Err("the issuer is down".to_string()));
        assert!(
            function
                .current()
                .await
                .unwrap_err()
                .contains("the issuer is down")
        );
        assert_eq!(format!("{function:?}"), "Token(function)");
    }
}
