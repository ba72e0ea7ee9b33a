#include <sqlite3.h>

/// Keeps SQLite from checkpointing the WAL into the database file when this connection closes
/// (sqlite3_db_config is variadic, which Swift cannot call).
static inline int dq_sqlite3_no_checkpoint_on_close(sqlite3 *db) {
    return sqlite3_db_config(db, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, (int *)0);
}
