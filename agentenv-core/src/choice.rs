//! Settings with a fixed set of spellings (log level, log format, placement
//! strategy, discovery mode), typed.
//!
//! Such a setting is read leniently: text that names no choice is kept as
//! `Unknown` instead of failing the read, so it is only rejected where the
//! setting is validated (the running service's section, after the
//! environment had its say), with the message of the strict `parse`.

/// Declares a setting enum: the listed choices (each with its canonical
/// spelling and optional aliases, matched after trimming and lowercasing)
/// plus `Unknown(String)` for any other text, kept as written.
///
/// The enum gets `from_name` (the matching), `as_str`, `is_known`, lenient
/// `From<&str>`/`From<String>` (through the enum's own strict `parse`, which
/// the caller writes with its error message), serde deserialisation from the
/// same strings, `Display`, and comparison with `&str`.
macro_rules! text_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal $(| $alias:literal)*, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, Default, serde::Deserialize)]
        #[serde(from = "String")]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
            /// Text that names no choice, as written; validation rejects it.
            Unknown(String),
        }

        impl $name {
            /// The choice spelled `name` (already trimmed and lowercased).
            fn from_name(name: &str) -> Option<Self> {
                match name {
                    $( $text $(| $alias)* => Some(Self::$variant), )+
                    _ => None,
                }
            }

            /// The canonical spelling; for `Unknown`, the text as written.
            pub fn as_str(&self) -> &str {
                match self {
                    $( Self::$variant => $text, )+
                    Self::Unknown(text) => text,
                }
            }

            /// Whether this is one of the choices (not `Unknown`).
            pub fn is_known(&self) -> bool {
                !matches!(self, Self::Unknown(_))
            }
        }

        impl From<&str> for $name {
            fn from(text: &str) -> Self {
                Self::parse(text).unwrap_or_else(|_| Self::Unknown(text.to_string()))
            }
        }

        impl From<String> for $name {
            fn from(text: String) -> Self {
                match Self::parse(&text) {
                    Ok(choice) => choice,
                    Err(_) => Self::Unknown(text),
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.as_str() == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.as_str() == *other
            }
        }
    };
}

pub(crate) use text_enum;

/// Trims and lowercases a setting's text for matching.
pub(crate) fn normalize(text: &str) -> String {
    text.trim().to_ascii_lowercase()
}
