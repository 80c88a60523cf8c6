// CheckDaemonSocket: why this process cannot reach dosd's unix socket, said
// before it tries to connect (gRPC would only say "failed to connect").
//
// The packaged dosd serves /run/dos/dosd.sock: /run/dos is mode 0750 and the
// socket 0660, both of group dos, so a user reaches it only as a member of
// that group, and a login keeps the groups it started with: a user added by
// `usermod -aG dos` is not in the group until they log in again. stat()
// then fails with EACCES, which is not "no daemon". The one place that tells
// these apart for dosctl, dos_daemon_probe (`python -m dos`) and dos_attach.
//
// Thread-safety: a free function; safe from any thread.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace dos {

// OK when `path` is a unix socket this process may connect to (it may enter
// every folder on the way and write the socket). Otherwise, with a message
// that starts with what is wrong at `path` and ends with the fix:
//   UNAVAILABLE         nothing there: no dosd (how to start one, DOS_SOCKET)
//   PERMISSION_DENIED   a folder on the way, or the socket, refuses this
//                       process: names it, its mode and group, and the fix
//                       (join the group and log in again; log in again when
//                       the account is in it but this login is not)
//   FAILED_PRECONDITION something that is not a socket is there
absl::Status CheckDaemonSocket(const std::string& path);

}  // namespace dos
