//! Newtypes for identities.

use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// Wraps a string as this identity (no validation: see [`crate::EventValidator`]).
            pub fn new(value: impl Into<String>) -> Self {
                Self(value.into())
            }

            /// The identity as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<&str> for $name {
            fn from(value: &str) -> Self {
                Self(value.to_owned())
            }
        }
    };
}

string_id!(
    /// A producer-assigned, stable event identity. Duplicate identity is `(tenant, event_id)`.
    EventId
);
string_id!(
    /// A tenant: the unit of authorization, quotas and isolation.
    TenantId
);
string_id!(
    /// A producer: one sending process of a tenant, with its own sequence numbers.
    ProducerId
);
