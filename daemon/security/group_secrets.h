// What daemons keep and send of a group's token, so that the token itself never travels between daemons
// (docs/security.md, "Tokens never travel between daemons"). The coordinator makes the token and gives it to the
// client that created the group; members get its digest (to check Attach and the fd side channel), the data key
// (the socket wire's connections) and the deletion key; a forwarded DeleteGroup carries a proof made with the
// deletion key. Each is a one-way function of the token: none of them gives the token back.
#pragma once

#include <string>

namespace epfabric::daemon::security {

// SHA-256 of the token, hex.
std::string TokenDigest(const std::string& token);
// Whether `token`'s digest is `digest`, in constant time (an empty token matches nothing).
bool TokenMatchesDigest(const std::string& token, const std::string& digest);
// HMAC-SHA256(token, "epfabric data v1"), hex: the key the group's data connections prove and are sealed with.
std::string DataKey(const std::string& token);
// HMAC-SHA256(token, "epfabric retire v1"), hex.
std::string DeletionKey(const std::string& token);
// HMAC-SHA256(deletion key, "epfd-retire|" name "|" nonce), hex: a forwarded DeleteGroup's proof of the token.
std::string RetireProof(const std::string& deletion_key, const std::string& name, const std::string& nonce);
// Whether `proof` is RetireProof(deletion_key, name, nonce), in constant time; false for an empty key or a nonce that
// is not 32 hex digits.
bool RetireProofMatches(const std::string& deletion_key, const std::string& name, const std::string& nonce,
                        const std::string& proof);

}  // namespace epfabric::daemon::security
