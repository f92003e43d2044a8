//! API keys: bearer tokens, stored only as their SHA-256, each bound to one tenant and the
//! producers it may speak for.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::config::GatewayConfig;

/// What a key grants.
#[derive(Debug, Clone)]
pub struct Grant {
    /// Index of the tenant in the configuration (quota and queue accounting).
    pub tenant_index: usize,
    /// The tenant the key is bound to.
    pub tenant: Arc<str>,
    /// The producers it may speak for; `None` means any producer of the tenant.
    pub producers: Option<Arc<HashSet<String>>>,
}

impl Grant {
    /// Whether this key may send events of `producer_id`.
    pub fn allows_producer(&self, producer_id: &str) -> bool {
        self.producers
            .as_ref()
            .is_none_or(|set| set.contains(producer_id))
    }
}

/// Resolves bearer tokens to grants.
#[derive(Debug, Clone)]
pub struct Authenticator {
    by_hash: HashMap<[u8; 32], Grant>,
}

/// The SHA-256 of a token, as lower-case hex: what the configuration stores.
pub fn hash_token(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

impl Authenticator {
    /// Builds the key table from a validated configuration.
    pub fn new(config: &GatewayConfig) -> Self {
        let mut by_hash = HashMap::new();
        for (tenant_index, t) in config.tenants.iter().enumerate() {
            let tenant: Arc<str> = Arc::from(t.id.as_str());
            for key in &t.keys {
                let mut digest = [0u8; 32];
                if hex::decode_to_slice(key.sha256.to_ascii_lowercase(), &mut digest).is_err() {
                    continue;
                }
                let producers = if key.producers.iter().any(|p| p == "*") {
                    None
                } else {
                    Some(Arc::new(key.producers.iter().cloned().collect()))
                };
                by_hash.insert(
                    digest,
                    Grant {
                        tenant_index,
                        tenant: Arc::clone(&tenant),
                        producers,
                    },
                );
            }
        }
        Self { by_hash }
    }

    /// The grant of `token`, if it is a known key.
    pub fn authenticate(&self, token: &str) -> Option<&Grant> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        self.by_hash.get(&digest)
    }
}
