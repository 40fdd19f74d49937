//! The typed choices of the scheduler section: placement strategy and
//! discovery mode.

use super::BUILTIN_STRATEGIES;
use crate::choice::normalize;

crate::choice::text_enum! {
    /// The scheduler's built-in placement strategy (`scheduler.strategy`).
    pub enum Strategy {
        /// Candidates in turn.
        #[default]
        RoundRobin = "round_robin",
        /// A uniformly random candidate.
        Random = "random",
        /// The candidate with the fewest sandboxes.
        LeastLoaded = "least_loaded",
        /// The less loaded of two random candidates.
        PowerOfTwo = "power_of_two",
    }
}

impl Strategy {
    /// Parses a strategy name, case-insensitively.
    pub fn parse(s: &str) -> Result<Self, String> {
        Self::from_name(&normalize(s)).ok_or_else(|| {
            format!(
                "unknown strategy {s:?}: use one of {}",
                BUILTIN_STRATEGIES.join(", ")
            )
        })
    }
}

crate::choice::text_enum! {
    /// Where the scheduler learns its nodes (`scheduler.discovery.mode`).
    pub enum DiscoveryMode {
        /// The `scheduler.nodes` list (also for an empty mode).
        #[default]
        Static = "static" | "",
        /// Kubernetes endpoints.
        Kubernetes = "kubernetes",
    }
}

impl DiscoveryMode {
    /// Parses a discovery mode, case-insensitively; empty means static.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mode = normalize(s);
        Self::from_name(&mode)
            .ok_or_else(|| format!("unknown mode {mode:?}: use static or kubernetes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{BoolSyntax, parse_bool};

    #[test]
    fn strategies_read_leniently_and_validate_strictly() {
        for name in BUILTIN_STRATEGIES {
            let s = Strategy::from(name);
            assert!(s.is_known(), "{name}");
            assert_eq!(s.as_str(), name);
        }
        assert_eq!(Strategy::from(" Least_Loaded "), Strategy::LeastLoaded);
        let odd = Strategy::from("round-robin");
        assert_eq!(odd, Strategy::Unknown("round-robin".into()));
        assert_eq!(odd.to_string(), "round-robin");
        let e = Strategy::parse(odd.as_str()).unwrap_err();
        assert!(e.starts_with("unknown strategy \"round-robin\""), "{e}");
    }

    #[test]
    fn blank_mode_is_static_and_unknown_modes_name_the_choices() {
        assert_eq!(DiscoveryMode::from(""), DiscoveryMode::Static);
        assert_eq!(
            DiscoveryMode::from(" Kubernetes "),
            DiscoveryMode::Kubernetes
        );
        assert_eq!(
            DiscoveryMode::parse(" Consul "),
            Err("unknown mode \"consul\": use static or kubernetes".into())
        );
    }

    #[test]
    fn booleans_accept_the_words_only_where_asked() {
        for (text, want) in [("1", true), ("T", true), ("True", true), ("f", false)] {
            assert_eq!(parse_bool(text, BoolSyntax::Plain), Some(want), "{text}");
            assert_eq!(
                parse_bool(text, BoolSyntax::WithWords),
                Some(want),
                "{text}"
            );
        }
        for (text, want) in [(" yes ", true), ("ON", true), ("no", false), ("", false)] {
            assert_eq!(parse_bool(text, BoolSyntax::Plain), None, "{text}");
            assert_eq!(
                parse_bool(text, BoolSyntax::WithWords),
                Some(want),
                "{text}"
            );
        }
        assert_eq!(parse_bool("maybe", BoolSyntax::WithWords), None);
    }
}
