//! Audit: reconciliation of a job's outputs against an independent SQL oracle over the
//! landing table ([`reconcile()`], [`write_reports`]), and the capacity model ([`plan()`]).
//!
//! Depends on `lake`, `window` and `model` only: the command line resolves which job
//! version and output table a namespace holds, and fetches measured figures.

pub mod error;
pub mod plan;
pub mod reconcile;
pub mod report;

pub use error::{AuditError, Result};
pub use plan::{Measured, Plan, Sheet, plan};
pub use reconcile::{ReconcileRequest, Report, Verdict, reconcile};
pub use report::{html, markdown, write_reports};
