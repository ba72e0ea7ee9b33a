#ifndef CSPAWN_H
#define CSPAWN_H

#include <spawn.h>

/// glibc's posix_spawn_file_actions_addclosefrom_np (2.34): the child closes every descriptor from `from` on.
/// Swift's Glibc module does not show it (it is a GNU extension); nor the next one.
int cspawn_file_actions_addclosefrom(posix_spawn_file_actions_t *actions, int from);

/// glibc's posix_spawn_file_actions_addchdir_np (2.29): the child changes to `path` before its program starts.
int cspawn_file_actions_addchdir(posix_spawn_file_actions_t *actions, const char *path);

#endif
