//! Customer notifications: an effect boundary that replay cannot break.
//!
//! A notification is an external effect: replaying a window does not unsend an email. The
//! [`Notifier`] derives effects from a window job's output versions and records each as a
//! row of the [`Ledger`] (the outbox, in the catalog database) with a stable id, in the
//! same transaction as its source position. The [`Dispatcher`] sends them with the id as
//! the idempotency key, retries within a deadline, and resolves an ambiguous outcome by
//! asking the provider, never by sending blindly. [`sink`] is a provider for tests and the
//! demo.

pub mod dispatch;
pub mod error;
pub mod ledger;
pub mod notifier;
pub mod sink;
pub mod spec;

pub use dispatch::{DispatchReport, Dispatcher, Lookup, Notification};
pub use error::{EffectError, Result};
pub use ledger::{Effect, Intent, Ledger, state};
pub use notifier::{Notifier, NotifyStep};
pub use spec::{NotificationSpec, effect_id};
