//! Which business process a message is for: a router plugin's `route`, or
//! the built-in rule (the `process-id` header, else the message key); and
//! the plugin's say in where a new process connects (`place`, used by
//! [`super::placement`]).

use std::sync::Arc;

use crate::flow::chain::to_plugin_message;
use crate::kafka::{InputRecord, OutputRecord};
use crate::plugin::PluginRegistry;

/// The header the built-in router reads the process id from.
pub const PROCESS_ID_HEADER: &str = "process-id";

/// Names the process of each message.
#[derive(Clone)]
pub struct ProcessRouter {
    plugin: Option<String>,
    registry: Arc<PluginRegistry>,
}

impl std::fmt::Debug for ProcessRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessRouter")
            .field("plugin", &self.plugin)
            .finish_non_exhaustive()
    }
}

/// Why a message has no process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteFailure {
    /// `router:<plugin>@<sha256>` or `router:built-in`.
    pub stage: String,
    /// What went wrong.
    pub reason: String,
}

impl ProcessRouter {
    /// Routes with `plugin` (a router-world plugin in `registry`), or with
    /// the built-in rule when `None`.
    pub fn new(plugin: Option<String>, registry: Arc<PluginRegistry>) -> ProcessRouter {
        ProcessRouter { plugin, registry }
    }

    /// Whether a router plugin is configured (else the built-in rule).
    pub fn has_plugin(&self) -> bool {
        self.plugin.is_some()
    }

    /// The router plugin's `place`: which of `loads`' nodes should accept
    /// a new connection of `process_id` (`None`: the built-in rule
    /// decides, as it does without a plugin). The error names the plugin.
    pub async fn place(
        &self,
        process_id: &str,
        loads: &[super::placement::NodeLoad],
    ) -> Result<Option<String>, String> {
        let Some(name) = &self.plugin else {
            return Ok(None);
        };
        let version = self.registry.current(name).map_err(|e| e.to_string())?;
        let nodes: Vec<crate::plugin::NodeLoad> = loads
            .iter()
            .map(|l| crate::plugin::NodeLoad {
                node_id: l.node_id.clone(),
                live: true,
                connections: l.connections,
                quota: l.quota,
            })
            .collect();
        let process_id = process_id.to_string();
        let label = format!("router:{}@{}", version.name(), version.sha256());
        tokio::task::spawn_blocking(move || version.place(&process_id, &nodes))
            .await
            .map_err(|e| format!("{label}: the place task failed: {e}"))?
            .map_err(|e| format!("{label}: {e}"))
    }

    /// The process id of `message` (which came from `input`).
    pub async fn route(
        &self,
        input: &InputRecord,
        message: &OutputRecord,
    ) -> Result<String, RouteFailure> {
        let Some(name) = &self.plugin else {
            return built_in_route_or_failure(message);
        };
        let version = self.registry.current(name).map_err(|e| RouteFailure {
            stage: format!("router:{name}"),
            reason: e.to_string(),
        })?;
        let stage = format!("router:{}@{}", version.name(), version.sha256());
        let plugin_message = to_plugin_message(input, message.clone());
        let routed = tokio::task::spawn_blocking(move || version.route(&plugin_message))
            .await
            .map_err(|e| format!("router task failed: {e}"))
            .and_then(|answer| answer.map_err(|e| e.to_string()));
        match routed {
            Ok(Some(process_id)) => wasmrelay_protocol::check_process_id(&process_id)
                .map(|()| process_id)
                .map_err(|reason| RouteFailure {
                    stage,
                    reason: format!("the router answered a bad process id: {reason}"),
                }),
            Ok(None) => Err(RouteFailure {
                stage,
                reason: "the router found no process for the message".to_string(),
            }),
            Err(reason) => Err(RouteFailure { stage, reason }),
        }
    }
}

impl ProcessRouter {
    /// The process of `message` when no plugin routes (the built-in rule);
    /// `None` when the router plugin must be asked ([`ProcessRouter::route`]).
    pub fn route_without_plugin(
        &self,
        message: &OutputRecord,
    ) -> Option<Result<String, RouteFailure>> {
        self.plugin
            .is_none()
            .then(|| built_in_route_or_failure(message))
    }
}

/// [`built_in_route`], or why it found no process.
fn built_in_route_or_failure(message: &OutputRecord) -> Result<String, RouteFailure> {
    built_in_route(message).ok_or_else(|| RouteFailure {
        stage: "router:built-in".to_string(),
        reason: format!(
            "no process id: the message has no `{PROCESS_ID_HEADER}` header and no UTF-8 key"
        ),
    })
}

/// The built-in rule: the `process-id` header, else the key, as UTF-8.
fn built_in_route(message: &OutputRecord) -> Option<String> {
    let raw = message
        .header(PROCESS_ID_HEADER)
        .or(message.key.as_deref())?;
    let id = std::str::from_utf8(raw).ok()?.to_string();
    wasmrelay_protocol::check_process_id(&id).ok()?;
    Some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_wins_over_the_key() {
        let mut message = OutputRecord {
            key: Some(b"from-key".to_vec()),
            ..OutputRecord::default()
        };
        assert_eq!(built_in_route(&message).as_deref(), Some("from-key"));
        message.set_header(PROCESS_ID_HEADER, "from-header");
        assert_eq!(built_in_route(&message).as_deref(), Some("from-header"));
        message.key = None;
        message.headers.clear();
        assert_eq!(built_in_route(&message), None);
        message.key = Some(vec![0xff]);
        assert_eq!(built_in_route(&message), None);
    }
}
