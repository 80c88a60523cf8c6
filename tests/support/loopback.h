// Loopback TCP helpers for tests of dosd's TCP listeners (metrics, gRPC).
//
// Thread-safety: plain functions.
#pragma once

#include <string>

namespace dos::testing {

// A port on 127.0.0.1 that was free a moment ago (the kernel's pick).
int FreeLoopbackPort();
// A connected socket to 127.0.0.1:`port` (close-on-exec), or -1.
int ConnectLoopback(int port);
// The whole response (headers and body) to "GET `path`" on 127.0.0.1:`port`;
// "" if nothing listens there.
std::string HttpGet(int port, const std::string& path);

}  // namespace dos::testing
