//! Kindred's routing: how nodes whose updates point the same way find each other.
//!
//! libp2p-kad hashes record keys before measuring XOR distance, so similar keys do not land on
//! nearby nodes. Locality therefore comes from exact-bucket rendezvous: the 256-bit SimHash of an
//! update's embedding is cut into L bands of b bits, each band becomes one DHT key
//! (`blake3(network ‖ model ‖ round window ‖ band index ‖ band bits)`), and a node announces itself
//! as provider of its keys and looks up the same keys plus multi-probe neighbours. Similar updates
//! share at least one band with high probability, and each probe costs one O(log N) lookup.
//!
//! This crate will own those semantic keys (pure functions), the libp2p `NetworkBehaviour`
//! (Kademlia, identify, ping, and request-response for header and body fetches), peer scoring
//! and bans, and the local `hnsw_rs` index of seen headers used to rank candidates by cosine.
//! It does not train models or decide merge weights.
