//! The node's plugins at start: load every component in the plugins
//! directory and check that each plugin a flow names is loaded and of the
//! world the flow needs (processors in chains, a router for a cluster flow).

use std::sync::Arc;

use anyhow::bail;

use crate::config::{DeliverConfig, RelayConfig};
use crate::plugin::{PluginError, PluginRegistry, PluginRuntime, ScanReport, World};

/// Loads the plugins directory; every problem with a plugin a flow names is
/// reported at once, one per line.
pub(super) async fn load(config: &RelayConfig) -> anyhow::Result<Arc<PluginRegistry>> {
    let runtime = PluginRuntime::new(config.plugins.limits())?;
    let registry = Arc::new(PluginRegistry::new(
        runtime,
        config.plugins.dir.clone(),
        config.plugins.config.clone(),
    ));
    let report = registry.scan().await;
    let mut problems = Vec::new();
    for flow in &config.flows {
        for (chain, plugins) in [
            ("service_call", &flow.service_call),
            ("data_return", &flow.data_return),
        ] {
            for name in plugins {
                if let Some(problem) = check(&registry, &report, name, World::Processor) {
                    problems.push(format!("flow `{}` {chain}: {problem}", flow.name));
                }
            }
        }
        if let Some(DeliverConfig::Cluster(target)) = &flow.deliver
            && let Some(name) = &target.router
            && let Some(problem) = check(&registry, &report, name, World::Router)
        {
            problems.push(format!(
                "flow `{}` deliver.cluster.router: {problem}",
                flow.name
            ));
        }
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("\n"));
    }
    Ok(registry)
}

/// What is wrong with plugin `name` for a use that needs `world`, if
/// anything: not loaded (with the load error of its file, when there was
/// one) or of the other world.
fn check(
    registry: &PluginRegistry,
    report: &ScanReport,
    name: &str,
    world: World,
) -> Option<String> {
    match registry.get(name) {
        Some(slot) if slot.world() == world => None,
        Some(slot) => Some(format!(
            "plugin `{name}` is a {} plugin, not a {world}",
            slot.world()
        )),
        None => {
            let cause = report
                .failed
                .iter()
                .find(|error| matches!(error, PluginError::Load { file, .. } if file.file_stem().is_some_and(|stem| stem == name)))
                .map(|error| error.to_string())
                .unwrap_or_else(|| "no such file in the plugins directory".to_string());
            Some(format!("plugin `{name}` is not loaded: {cause}"))
        }
    }
}
