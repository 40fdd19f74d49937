//! The node's `[pool]` settings (pools of started sandboxes) and their `AENV_POOL_*`
//! overrides.

use std::time::Duration;

use super::ConfigError;
use super::file;
use super::invalid;
use super::values::{env_u64, pool_size};

/// The `[pool]` settings and their `AENV_POOL_*` overrides.
pub(super) fn settings(
    env: &dyn Fn(&str) -> Option<String>,
    file: &file::FilePool,
) -> Result<crate::lifecycle::PoolSettings, ConfigError> {
    use crate::lifecycle::PoolSettings;
    let d = PoolSettings::default();
    let templates = match env("AENV_POOL_TEMPLATES") {
        Some(v) => PoolSettings::parse_templates(&v)
            .map_err(|fix| invalid("AENV_POOL_TEMPLATES", v.clone(), fix))?,
        None => file
            .templates
            .iter()
            .flatten()
            .map(|(k, v)| Ok((k.clone(), pool_size("pool.templates", *v)?)))
            .collect::<Result<_, ConfigError>>()?,
    };
    let max = pool_size(
        "pool.max_per_template",
        env_u64(env, "AENV_POOL_MAX_PER_TEMPLATE")?
            .or(file.max_per_template)
            .unwrap_or(d.max_per_template as u64),
    )?;
    let window_ms = env_u64(env, "AENV_POOL_DEMAND_WINDOW_MS")?
        .or(file.demand_window_ms)
        .unwrap_or(d.demand_window.as_millis() as u64);
    if !(100..=600_000).contains(&window_ms) {
        return Err(invalid(
            "pool.demand_window_ms",
            window_ms.to_string(),
            "use 100 to 600000",
        ));
    }
    let concurrency = env_u64(env, "AENV_POOL_REFILL_CONCURRENCY")?
        .or(file.refill_concurrency)
        .unwrap_or(d.refill_concurrency as u64);
    if !(1..=64).contains(&concurrency) {
        return Err(invalid(
            "pool.refill_concurrency",
            concurrency.to_string(),
            "use 1 to 64",
        ));
    }
    Ok(PoolSettings {
        templates,
        max_per_template: max,
        demand_window: Duration::from_millis(window_ms),
        memory_reserve_mb: env_u64(env, "AENV_POOL_MEMORY_RESERVE_MB")?.or(file.memory_reserve_mb),
        refill_concurrency: concurrency as usize,
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::load;
    use std::time::Duration;

    #[test]
    fn pools_come_from_the_file_or_the_environment_and_bad_values_are_named() {
        let c = load(&[], None).unwrap();
        assert!(!c.pool.enabled());
        let c = load(
            &[],
            Some("[pool]\ntemplates = { base = 2, py = 1 }\nmax_per_template = 4\nmemory_reserve_mb = 512\n"),
        )
        .unwrap();
        assert_eq!(c.pool.templates.get("base"), Some(&2));
        assert_eq!(c.pool.templates.get("py"), Some(&1));
        assert_eq!(c.pool.max_per_template, 4);
        assert_eq!(c.pool.memory_reserve_mb, Some(512));
        let c = load(
            &[
                ("AENV_POOL_TEMPLATES", "base=3"),
                ("AENV_POOL_DEMAND_WINDOW_MS", "500"),
            ],
            Some("[pool]\ntemplates = { py = 1 }\n"),
        )
        .unwrap();
        assert_eq!(c.pool.templates.len(), 1);
        assert_eq!(c.pool.templates.get("base"), Some(&3));
        assert_eq!(c.pool.demand_window, Duration::from_millis(500));
        for (k, v, named) in [
            ("AENV_POOL_TEMPLATES", "base", "AENV_POOL_TEMPLATES"),
            (
                "AENV_POOL_MAX_PER_TEMPLATE",
                "5000",
                "pool.max_per_template",
            ),
            ("AENV_POOL_DEMAND_WINDOW_MS", "5", "pool.demand_window_ms"),
            (
                "AENV_POOL_REFILL_CONCURRENCY",
                "0",
                "pool.refill_concurrency",
            ),
        ] {
            let e = load(&[(k, v)], None).unwrap_err();
            assert!(e.to_string().contains(named), "{k}={v}: {e}");
        }
        assert!(load(&[], Some("[pool]\nsize = 2\n")).is_err());
    }
}
