//! A live deploy's new plugin, prepared off the job's thread (in the control API's
//! threads): the component read, compiled (or taken from the cache), instantiated, asked
//! who it is, configured for every aggregation it replaces and stored with the
//! checkpoints. What the job does with it is job/swap.rs's.

use super::upgrade::Refusal;
use crate::checkpoint::components::Component;
use crate::pipeline::Pipeline;
use crate::plugin::{Plugin, PluginRuntime};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The largest component a live deploy takes by default (the Python SDK's are ~20 MB).
pub const MAX_COMPONENT_BYTES: usize = 64 << 20;

/// A new plugin, ready to be swapped in.
pub struct Deployment {
    /// Configured for each aggregation it replaces (by index in the pipeline).
    pub plugins: Vec<(usize, Plugin)>,
    pub component: Component,
    /// How long preparing it took.
    pub prepare: Duration,
}

/// Prepares live deploys for one job (in the control API's threads).
pub struct Deployer {
    runtime: Arc<PluginRuntime>,
    pipeline: Pipeline,
    /// The largest component taken.
    pub max_bytes: usize,
}

impl Deployer {
    pub fn new(runtime: Arc<PluginRuntime>, pipeline: Pipeline) -> Deployer {
        Deployer { runtime, pipeline, max_bytes: MAX_COMPONENT_BYTES }
    }

    /// Read, compile, instantiate and configure `bytes` for the aggregations it replaces:
    /// `aggregation`, or every one whose plugin (`running`: each aggregation's plugin name,
    /// in pipeline order) has the new plugin's name.
    pub fn prepare(
        &self,
        bytes: Vec<u8>,
        aggregation: Option<&str>,
        running: &[String],
    ) -> std::result::Result<Deployment, Refusal> {
        let t = Instant::now();
        if bytes.len() > self.max_bytes {
            return Err(Refusal::TooLarge { bytes: bytes.len(), max: self.max_bytes });
        }
        let component = Component::new(bytes);
        let label = format!("uploaded component {}", &component.sha256[..12]);
        let (identity, _) = self
            .runtime
            .inspect_bytes(&label, &component.bytes)
            .map_err(|e| Refusal::NotAPlugin(Box::new(e)))?;
        let aggregations = &self.pipeline.aggregations;
        if running.len() != aggregations.len() {
            return Err(Refusal::Starting);
        }
        let targets: Vec<usize> = match aggregation {
            Some(name) => {
                let Some(i) = aggregations.iter().position(|a| a.name == name) else {
                    let known = aggregations.iter().map(|a| a.name.clone()).collect();
                    return Err(Refusal::NoAggregation { name: name.to_string(), known });
                };
                if running[i] != identity.name {
                    return Err(Refusal::OtherLogic {
                        aggregation: aggregations[i].name.clone(),
                        held: running[i].clone(),
                        offered: identity.name,
                    });
                }
                vec![i]
            }
            None => {
                let found: Vec<usize> = (0..running.len()).filter(|&i| running[i] == identity.name).collect();
                if found.is_empty() {
                    return Err(Refusal::ReplacesNothing { held: running.to_vec(), offered: identity.name });
                }
                found
            }
        };
        let mut plugins = Vec::new();
        for i in targets {
            let a = &aggregations[i];
            let p = self
                .runtime
                .load_bytes(&label, &component.bytes, &a.plugin.config, a.plugin.limits)
                .map_err(|e| Refusal::Configure { aggregation: a.name.clone(), source: Box::new(e) })?;
            plugins.push((i, p));
        }
        // Kept with the checkpoints before any checkpoint records it.
        if let Some(c) = &self.pipeline.checkpoints {
            component.put(&c.dir).map_err(|e| Refusal::NotStored(Box::new(e)))?;
        }
        Ok(Deployment { plugins, component, prepare: t.elapsed() })
    }

    /// The same deployment for another task of the job: its own plugin instances, the
    /// component stored with its checkpoints (`checkpoints`).
    pub fn again(
        &self,
        d: &Deployment,
        checkpoints: Option<&Path>,
    ) -> std::result::Result<Deployment, Refusal> {
        let t = Instant::now();
        let label = format!("uploaded component {}", &d.component.sha256[..12]);
        let mut plugins = Vec::with_capacity(d.plugins.len());
        for (i, _) in &d.plugins {
            let a = &self.pipeline.aggregations[*i];
            let p = self
                .runtime
                .load_bytes(&label, &d.component.bytes, &a.plugin.config, a.plugin.limits)
                .map_err(|e| Refusal::Configure { aggregation: a.name.clone(), source: Box::new(e) })?;
            plugins.push((*i, p));
        }
        if let Some(dir) = checkpoints {
            d.component.put(dir).map_err(|e| Refusal::NotStored(Box::new(e)))?;
        }
        Ok(Deployment { plugins, component: d.component.clone(), prepare: t.elapsed() })
    }
}
