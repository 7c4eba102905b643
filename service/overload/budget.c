/* The response budget's books, its tickets, the drain watchdog's entry for a ticket and the compiled fast path's
 * admission, each one compiled call: what every call pays for the budget (docs/overload.md, "Memory").
 *
 * Why: a ticket's life in Python (the reservation under the budget's lock, the ticket's dataclass, the watchdog's
 * entry with its functools.partial, the release on gRPC's polling thread, the fast path's admission) is a visible
 * share of a small BuildChunk's server CPU under load (docs/performance.md).
 *
 * The rules are written twice, here and in service/overload/books.py (the Python twin, used where this module is not
 * built); tests/service/test_budget_books.py holds the two equal operation for operation, on random sequences and on
 * every branch of the fast path's admission. Each change of the books runs under the GIL with no Python code between
 * reading them and writing them (what may run Python, such as making a tracked object, comes first): that, not a
 * lock, makes it atomic (service/overload/admission.py's ResponseBudget waits on a Condition around it, and is
 * notified through `notify`). What runs Python comes after the change: the books' gauge (`set_held`, called again
 * while the books moved on meanwhile, as a gauge written in Python may let another thread run, so the last value
 * written is what the books hold), `notify`, the ticket's `forget`, and FastAdmit's look at its caller. Errors after
 * the change follow the twin's `try/finally`: every step runs, and the last error is the one raised.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <time.h>

/* ---- the books ------------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    long long limit, share, held;
    Py_ssize_t waiters; /* threads waiting in ResponseBudget.reserve: a release calls notify when there are some */
    PyObject *by_peer;  /* str -> int: each connection's bytes held, only those holding some */
    PyObject *set_held; /* the gauge's set(value) */
    PyObject *notify;   /* wakes the waiters (takes the budget's Condition) */
} Books;

typedef struct {
    PyObject_HEAD
    Books *budget;
    PyObject *peer;
    long long nbytes;
    int released;
    PyObject *forget;  /* called once, on release (the watchdog's forgetting, set by DrainWatchdog.watch), or NULL */
    PyObject *watched; /* the watchdog's dict of entries, which holds this one's under id(ticket) (watch()), or NULL */
} Ticket;

static PyTypeObject BooksType, TicketType;

/* The gauge set to what the books hold; a failure to set it is reported (sys.unraisablehook), not raised: the books
 * have changed by then, and a call must not fail over its gauge. */
static void publish(Books *b) {
    if (!b->set_held) return; /* not initialised */
    for (int tries = 0; tries < 64; tries++) {
        long long value = b->held;
        PyObject *number = PyLong_FromLongLong(value);
        PyObject *result = number ? PyObject_CallOneArg(b->set_held, number) : NULL;
        Py_XDECREF(number);
        if (!result) {
            PyErr_WriteUnraisable(b->set_held);
            return;
        }
        Py_DECREF(result);
        if (b->held == value) return;
    }
    /* the books keep moving: the threads moving them publish after their own change */
}

/* An error kept while later steps run, as Python's `finally` blocks run after one: a later step's error replaces it. */
typedef struct {
    PyObject *type, *value, *traceback;
} Pending;

/* After a step: its error, if any, becomes the pending one (the earlier dropped), and none is set any more. */
static void settle(Pending *p) {
    if (!PyErr_Occurred()) return;
    Py_XDECREF(p->type);
    Py_XDECREF(p->value);
    Py_XDECREF(p->traceback);
    PyErr_Fetch(&p->type, &p->value, &p->traceback);
}

/* -1 with the pending error set, or 0 when there is none. */
static int raise_pending(Pending *p) {
    if (!p->type) return 0;
    PyErr_Restore(p->type, p->value, p->traceback);
    return -1;
}

/* The books exist from the start: an uninitialised Books (limit 0) has no room, and never crashes. */
static PyObject *Books_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    (void)args;
    (void)kwargs;
    Books *self = (Books *)type->tp_alloc(type, 0);
    if (self && !(self->by_peer = PyDict_New())) Py_CLEAR(self);
    return (PyObject *)self;
}

static int Books_init(Books *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"limit", "share", "set_held", "notify", NULL};
    long long limit, share;
    PyObject *set_held, *notify;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LLOO:Books", names, &limit, &share, &set_held, &notify)) return -1;
    if (limit < 1 || share < 1) {
        PyErr_SetString(PyExc_ValueError, "Books: limit and share must be at least 1");
        return -1;
    }
    if (self->set_held) { /* books in use: starting them again would forget what their tickets hold */
        PyErr_SetString(PyExc_TypeError, "Books: already initialised");
        return -1;
    }
    self->limit = limit;
    self->share = share;
    Py_INCREF(set_held);
    Py_XSETREF(self->set_held, set_held);
    Py_INCREF(notify);
    Py_XSETREF(self->notify, notify);
    publish(self);
    return 0;
}

static int Books_traverse(Books *self, visitproc visit, void *arg) {
    Py_VISIT(self->by_peer);
    Py_VISIT(self->set_held);
    Py_VISIT(self->notify);
    return 0;
}

static int Books_clear(Books *self) {
    Py_CLEAR(self->by_peer);
    Py_CLEAR(self->set_held);
    Py_CLEAR(self->notify);
    return 0;
}

static void Books_dealloc(Books *self) {
    PyObject_GC_UnTrack(self);
    Books_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The bytes `peer` holds (0: none); -1 with an exception. */
static long long peer_bytes(Books *b, PyObject *peer) {
    PyObject *mine = PyDict_GetItemWithError(b->by_peer, peer);
    if (!mine) return PyErr_Occurred() ? -1 : 0;
    return PyLong_AsLongLong(mine);
}

static int set_peer_bytes(Books *b, PyObject *peer, long long nbytes) {
    if (nbytes <= 0) {
        if (PyDict_DelItem(b->by_peer, peer) == 0) return 0;
        if (!PyErr_ExceptionMatches(PyExc_KeyError)) return -1;
        PyErr_Clear();
        return 0;
    }
    PyObject *value = PyLong_FromLongLong(nbytes);
    if (!value) return -1;
    int rc = PyDict_SetItem(b->by_peer, peer, value);
    Py_DECREF(value);
    return rc;
}

/* A ticket for `nbytes` of `peer` when they fit now, else Py_None (new references); NULL with an exception. The rule:
 * the budget's limit, and the connection's share unless it holds nothing yet. The ticket is made before the books are
 * read: making a tracked object may run the garbage collector, whose finalizers may let other threads change the
 * books, and nothing between the read and the change may. */
static PyObject *take(Books *b, PyObject *peer, long long nbytes) {
    if (!PyUnicode_CheckExact(peer)) return PyErr_Format(PyExc_TypeError, "take(): peer must be a str");
    if (nbytes < 0) return PyErr_Format(PyExc_ValueError, "take(): nbytes must be >= 0, got %lld", nbytes);
    Ticket *ticket = PyObject_GC_New(Ticket, &TicketType);
    if (!ticket) return NULL;
    Py_INCREF(b);
    ticket->budget = b;
    Py_INCREF(peer);
    ticket->peer = peer;
    ticket->nbytes = nbytes;
    ticket->released = 0;
    ticket->forget = NULL;
    ticket->watched = NULL;
    PyObject_GC_Track(ticket);
    long long mine = peer_bytes(b, peer);
    if (mine < 0) {
        Py_DECREF(ticket);
        return NULL;
    }
    /* held + nbytes > limit, mine + nbytes > share, without an overflow (held <= limit, mine <= limit) */
    if (nbytes > b->limit - b->held || (mine && nbytes > b->share - mine)) {
        Py_DECREF(ticket);
        Py_RETURN_NONE;
    }
    if (nbytes && set_peer_bytes(b, peer, mine + nbytes) < 0) { /* a connection holding nothing has no entry */
        Py_DECREF(ticket);
        return NULL;
    }
    b->held += nbytes;
    publish(b);
    return (PyObject *)ticket;
}

static PyObject *Books_take(Books *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "take() takes 2 positional arguments (%zd given)", nargs);
    long long nbytes = PyLong_AsLongLong(args[1]);
    if (nbytes == -1 && PyErr_Occurred()) return NULL;
    return take(self, args[0], nbytes);
}

/* What a release does once the books are right: the watchdog's entry popped, then the ticket's `forget` called (each
 * once, each whatever the step before raised: errors go to `p`). */
static void forget(Ticket *t, Pending *p) {
    PyObject *watched = t->watched, *fn = t->forget;
    t->watched = NULL;
    t->forget = NULL;
    if (watched) {
        PyObject *key = PyLong_FromVoidPtr(t); /* id(ticket): the entry's key; the entry holds the ticket */
        if (key && PyDict_DelItem(watched, key) < 0 && PyErr_ExceptionMatches(PyExc_KeyError)) {
            PyErr_Clear(); /* the scan dropped it first: dict.pop(key, None) */
        }
        Py_XDECREF(key);
        Py_DECREF(watched);
        settle(p);
    }
    if (fn) {
        PyObject *result = PyObject_CallNoArgs(fn);
        Py_XDECREF(result);
        Py_DECREF(fn);
        settle(p);
    }
}

/* `t` down to `keep` bytes (keep >= 0: the response turned out smaller), or released (keep < 0): once released it
 * gives back nothing more, and a ticket never grows back. Then the gauge, `notify` while there are waiters, and on
 * release the forgetting, each run whatever the one before raised. 0, or -1 with the last error. */
static int give_back(Books *b, Ticket *t, long long keep) {
    if (t->released) return 0;
    long long nbytes;
    if (keep < 0) {
        t->released = 1;
        nbytes = t->nbytes;
    } else if (keep < t->nbytes) {
        nbytes = t->nbytes - keep;
        t->nbytes = keep;
    } else {
        return 0;
    }
    long long mine = peer_bytes(b, t->peer);
    if (mine < 0 || set_peer_bytes(b, t->peer, mine - nbytes) < 0) return -1; /* the dict's own failure: as the twin */
    b->held -= nbytes;
    publish(b);
    Pending p = {NULL, NULL, NULL};
    if (b->waiters && b->notify) {
        PyObject *result = PyObject_CallNoArgs(b->notify);
        Py_XDECREF(result);
        settle(&p);
    }
    if (keep < 0) forget(t, &p);
    return raise_pending(&p);
}

static PyObject *Books_give_back(Books *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "give_back() takes 2 positional arguments (%zd given)", nargs);
    if (!PyObject_TypeCheck(args[0], &TicketType) || ((Ticket *)args[0])->budget != self) {
        return PyErr_Format(PyExc_ValueError, "give_back(): not a ticket of these books");
    }
    long long keep = -1;
    if (args[1] != Py_None) {
        keep = PyLong_AsLongLong(args[1]);
        if (keep == -1 && PyErr_Occurred()) return NULL;
        if (keep < 0) return PyErr_Format(PyExc_ValueError, "give_back(): keep must be None or >= 0");
    }
    if (give_back(self, (Ticket *)args[0], keep) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Books_peer_bytes(Books *self, PyObject *peer) {
    long long mine = peer_bytes(self, peer);
    return mine < 0 ? NULL : PyLong_FromLongLong(mine);
}

static PyObject *Books_get_held(Books *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(self->held);
}

static PyObject *Books_get_by_peer(Books *self, void *closure) {
    (void)closure;
    return PyDict_Copy(self->by_peer);
}

static PyObject *Books_get_waiters(Books *self, void *closure) {
    (void)closure;
    return PyLong_FromSsize_t(self->waiters);
}

static int Books_set_waiters(Books *self, PyObject *value, void *closure) {
    (void)closure;
    Py_ssize_t waiters = value ? PyLong_AsSsize_t(value) : -1;
    if (waiters < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "waiters must be an int >= 0");
        return -1;
    }
    self->waiters = waiters;
    return 0;
}

static PyObject *Books_get_limit(Books *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(self->limit);
}

static PyObject *Books_get_share(Books *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(self->share);
}

static PyMethodDef Books_methods[] = {
    {"take", (PyCFunction)(void (*)(void))Books_take, METH_FASTCALL,
     "take(peer, nbytes, /)\n--\n\nA Ticket for nbytes of peer when they fit now, else None."},
    {"give_back", (PyCFunction)(void (*)(void))Books_give_back, METH_FASTCALL,
     "give_back(ticket, keep, /)\n--\n\nThe ticket down to keep bytes, or released (keep None)."},
    {"peer_bytes", (PyCFunction)Books_peer_bytes, METH_O, "peer_bytes(peer, /)\n--\n\nThe bytes peer holds."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Books_getset[] = {
    {"held", (getter)Books_get_held, NULL, "Bytes held in all.", NULL},
    {"by_peer", (getter)Books_get_by_peer, NULL, "A copy of the bytes each connection holds.", NULL},
    {"waiters", (getter)Books_get_waiters, (setter)Books_set_waiters, "Threads waiting for room.", NULL},
    {"limit", (getter)Books_get_limit, NULL, "The most bytes held at once.", NULL},
    {"share", (getter)Books_get_share, NULL, "The most one connection holding anything may hold.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BooksType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "indexer_service.service.overload._budget.Books",
    .tp_basicsize = sizeof(Books),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Books(limit, share, set_held, notify)\n--\n\nThe response budget's books: see "
              "indexer_service.service.overload.books.Books, its Python twin.",
    .tp_new = Books_new,
    .tp_init = (initproc)Books_init,
    .tp_traverse = (traverseproc)Books_traverse,
    .tp_clear = (inquiry)Books_clear,
    .tp_dealloc = (destructor)Books_dealloc,
    .tp_methods = Books_methods,
    .tp_getset = Books_getset,
};

/* ---- the ticket ----------------------------------------------------------------------------------------- */

static int Ticket_traverse(Ticket *self, visitproc visit, void *arg) {
    Py_VISIT(self->budget);
    Py_VISIT(self->peer);
    Py_VISIT(self->forget);
    Py_VISIT(self->watched);
    return 0;
}

static int Ticket_clear(Ticket *self) {
    Py_CLEAR(self->budget);
    Py_CLEAR(self->peer);
    Py_CLEAR(self->forget);
    Py_CLEAR(self->watched);
    return 0;
}

static void Ticket_dealloc(Ticket *self) {
    PyObject_GC_UnTrack(self);
    Ticket_clear(self);
    PyObject_GC_Del(self);
}

static PyObject *Ticket_release(Ticket *self, PyObject *unused) {
    (void)unused;
    if (!self->budget) return PyErr_Format(PyExc_ValueError, "release(): the ticket's books are gone");
    if (give_back(self->budget, self, -1) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Ticket_get_budget(Ticket *self, void *closure) {
    (void)closure;
    PyObject *budget = self->budget ? (PyObject *)self->budget : Py_None;
    Py_INCREF(budget);
    return budget;
}

static PyObject *Ticket_get_peer(Ticket *self, void *closure) {
    (void)closure;
    PyObject *peer = self->peer ? self->peer : Py_None;
    Py_INCREF(peer);
    return peer;
}

static PyObject *Ticket_get_nbytes(Ticket *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(self->nbytes);
}

static PyObject *Ticket_get_released(Ticket *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->released);
}

static PyObject *Ticket_get_forget(Ticket *self, void *closure) {
    (void)closure;
    PyObject *fn = self->forget ? self->forget : Py_None;
    Py_INCREF(fn);
    return fn;
}

static int Ticket_set_forget(Ticket *self, PyObject *value, void *closure) {
    (void)closure;
    if (value == Py_None) value = NULL;
    Py_XINCREF(value);
    Py_XSETREF(self->forget, value);
    return 0;
}

static PyObject *Ticket_repr(Ticket *self) {
    return PyUnicode_FromFormat("Ticket(peer=%R, nbytes=%lld, released=%s)", self->peer ? self->peer : Py_None,
                                self->nbytes, self->released ? "True" : "False");
}

static PyMethodDef Ticket_methods[] = {
    {"release", (PyCFunction)Ticket_release, METH_NOARGS, "release()\n--\n\nGive all of it back (once)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ticket_getset[] = {
    {"budget", (getter)Ticket_get_budget, NULL, "The books it is held in.", NULL},
    {"peer", (getter)Ticket_get_peer, NULL, "The connection holding it.", NULL},
    {"nbytes", (getter)Ticket_get_nbytes, NULL, "The bytes held.", NULL},
    {"released", (getter)Ticket_get_released, NULL, "Whether it has been released.", NULL},
    {"forget", (getter)Ticket_get_forget, (setter)Ticket_set_forget, "Called once on release (or None).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TicketType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "indexer_service.service.overload._budget.Ticket",
    .tp_basicsize = sizeof(Ticket),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Bytes of the response budget held for one call, by one connection (made by Books.take).",
    .tp_traverse = (traverseproc)Ticket_traverse,
    .tp_clear = (inquiry)Ticket_clear,
    .tp_dealloc = (destructor)Ticket_dealloc,
    .tp_repr = (reprfunc)Ticket_repr,
    .tp_methods = Ticket_methods,
    .tp_getset = Ticket_getset,
};

/* ---- the drain watchdog's entry ------------------------------------------------------------------------- */

static double clock_seconds(clockid_t clock) {
    struct timespec now;
    clock_gettime(clock, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

/* watch(watched, seconds, ticket, on_unread): DrainWatchdog.watch for a Ticket of this module. */
static PyObject *watch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "watch() takes 4 positional arguments (%zd given)", nargs);
    PyObject *watched = args[0], *on_unread = args[3];
    if (!PyDict_CheckExact(watched)) return PyErr_Format(PyExc_TypeError, "watch(): watched must be a dict");
    if (!PyObject_TypeCheck(args[2], &TicketType)) return PyErr_Format(PyExc_TypeError, "watch(): not a Ticket");
    Ticket *ticket = (Ticket *)args[2];
    double seconds = PyFloat_AsDouble(args[1]);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    PyObject *key = PyLong_FromVoidPtr(ticket);
    PyObject *deadline = key ? PyFloat_FromDouble(clock_seconds(CLOCK_MONOTONIC) + seconds) : NULL;
    PyObject *entry = deadline ? PyTuple_Pack(3, deadline, (PyObject *)ticket, on_unread) : NULL;
    /* looked at after the allocations, which may run the garbage collector and so other threads */
    if (entry && ticket->watched) PyErr_SetString(PyExc_ValueError, "watch(): the ticket is watched already");
    int rc = entry && !ticket->watched ? PyDict_SetItem(watched, key, entry) : -1;
    Py_XDECREF(key);
    Py_XDECREF(deadline);
    Py_XDECREF(entry);
    if (rc < 0) return NULL;
    Py_INCREF(watched);
    ticket->watched = watched;
    if (ticket->released) { /* released before the entry existed: nobody else will pop it */
        Pending p = {NULL, NULL, NULL};
        forget(ticket, &p);
        if (raise_pending(&p) < 0) return NULL;
    }
    Py_RETURN_NONE;
}

/* ---- the compiled fast path's admission ----------------------------------------------------------------- */

/* FastAdmit(call, heavy_request_bytes, chunk_cost_bytes, books, general, stop_if_abandoned): the fast path's admit
 * (service/compute/fastpath.py BuildChunk) for the common call, the general one's (service/dataplane.py
 * DataPlane._admit_work) for every other: a call with no caller (`call` unset), a heavy one, a caller holding more
 * than a byte per answer byte (JSON), or an answer that does not fit now (the general admission waits). A caller
 * gone by the time its ticket is granted is `stop_if_abandoned(caller)`'s. */
typedef struct {
    PyObject_HEAD
    PyObject *call;    /* the data plane's ContextVar of the current caller */
    long long heavy_request_bytes, chunk_cost_bytes;
    Books *books;
    PyObject *general; /* admit(response_bytes, answer_bytes) */
    PyObject *stop_if_abandoned;
    vectorcallfunc vectorcall;
} FastAdmit;

static PyTypeObject FastAdmitType;
static PyObject *str_held_per_answer_byte, *str_peer, *str_ticket, *str_ended, *str_deadline;

static PyObject *FastAdmit_call(FastAdmit *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 2 || kwnames) {
        return PyErr_Format(PyExc_TypeError, "admit() takes 2 positional arguments (%zd given)", nargs);
    }
    if (!self->books) return PyErr_Format(PyExc_TypeError, "FastAdmit: not initialised");
    long long estimate = PyLong_AsLongLong(args[0]);
    if (estimate == -1 && PyErr_Occurred()) return NULL;
    long long answer_bytes = PyLong_AsLongLong(args[1]);
    if (answer_bytes == -1 && PyErr_Occurred()) return NULL;
    PyObject *caller;
    if (PyContextVar_Get(self->call, Py_None, &caller) < 0) return NULL;
    PyObject *ticket = NULL, *per_byte = NULL, *peer = NULL, *ended = NULL, *deadline = NULL, *result = NULL;
    /* estimate + chunk_cost_bytes > heavy_request_bytes, without an overflow (both settings are >= 0) */
    if (caller == Py_None || estimate > self->heavy_request_bytes - self->chunk_cost_bytes) goto general;
    if (!(per_byte = PyObject_GetAttr(caller, str_held_per_answer_byte))) goto done;
    if (!PyFloat_CheckExact(per_byte) || PyFloat_AS_DOUBLE(per_byte) != 1.0) goto general;
    if (!(peer = PyObject_GetAttr(caller, str_peer))) goto done;
    if (!PyUnicode_CheckExact(peer)) goto general;
    if (!(ticket = take(self->books, peer, answer_bytes))) goto done;
    if (ticket == Py_None) goto general;
    if (PyObject_SetAttr(caller, str_ticket, ticket) < 0) { /* nobody would release it: given back here */
        Pending p = {NULL, NULL, NULL};
        settle(&p);
        give_back(self->books, (Ticket *)ticket, -1);
        settle(&p); /* the release's own error, if any, is the last */
        raise_pending(&p);
        goto done;
    }
    /* Caller.gone()'s test (service/overload/admission.py) in C: a wait may have outlived the caller */
    if (!(ended = PyObject_GetAttr(caller, str_ended)) || !(deadline = PyObject_GetAttr(caller, str_deadline))) goto done;
    int is_ended = PyObject_IsTrue(ended);
    double until = PyFloat_AsDouble(deadline);
    if (is_ended < 0 || (until == -1.0 && PyErr_Occurred())) goto done;
    if (is_ended || clock_seconds(CLOCK_REALTIME) >= until) {
        PyObject *stopped = PyObject_CallOneArg(self->stop_if_abandoned, caller);
        if (!stopped) goto done;
        Py_DECREF(stopped);
    }
    Py_INCREF(caller);
    result = caller;
    goto done;
general:
    result = PyObject_Vectorcall(self->general, args, 2, NULL);
done:
    Py_XDECREF(ticket);
    Py_XDECREF(per_byte);
    Py_XDECREF(peer);
    Py_XDECREF(ended);
    Py_XDECREF(deadline);
    Py_DECREF(caller);
    return result;
}

static PyObject *FastAdmit_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    (void)args;
    (void)kwargs;
    FastAdmit *self = (FastAdmit *)type->tp_alloc(type, 0);
    if (self) self->vectorcall = (vectorcallfunc)FastAdmit_call; /* which refuses until __init__ has run */
    return (PyObject *)self;
}

static int FastAdmit_init(FastAdmit *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"call", "heavy_request_bytes", "chunk_cost_bytes", "books", "general", "stop_if_abandoned",
                            NULL};
    PyObject *call, *books, *general, *stop;
    long long heavy, chunk_cost;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OLLO!OO:FastAdmit", names, &call, &heavy, &chunk_cost, &BooksType,
                                     &books, &general, &stop)) {
        return -1;
    }
    if (heavy < 0 || chunk_cost < 0) {
        PyErr_SetString(PyExc_ValueError, "FastAdmit: heavy_request_bytes and chunk_cost_bytes must be >= 0");
        return -1;
    }
    if (!PyContextVar_CheckExact(call)) {
        PyErr_SetString(PyExc_TypeError, "FastAdmit: call must be a ContextVar");
        return -1;
    }
    Py_INCREF(call);
    Py_XSETREF(self->call, call);
    Py_INCREF(books);
    Py_XSETREF(self->books, (Books *)books);
    Py_INCREF(general);
    Py_XSETREF(self->general, general);
    Py_INCREF(stop);
    Py_XSETREF(self->stop_if_abandoned, stop);
    self->heavy_request_bytes = heavy;
    self->chunk_cost_bytes = chunk_cost;
    return 0;
}

static int FastAdmit_traverse(FastAdmit *self, visitproc visit, void *arg) {
    Py_VISIT(self->call);
    Py_VISIT(self->books);
    Py_VISIT(self->general);
    Py_VISIT(self->stop_if_abandoned);
    return 0;
}

static int FastAdmit_clear(FastAdmit *self) {
    Py_CLEAR(self->call);
    Py_CLEAR(self->books);
    Py_CLEAR(self->general);
    Py_CLEAR(self->stop_if_abandoned);
    return 0;
}

static void FastAdmit_dealloc(FastAdmit *self) {
    PyObject_GC_UnTrack(self);
    FastAdmit_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject FastAdmitType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "indexer_service.service.overload._budget.FastAdmit",
    .tp_basicsize = sizeof(FastAdmit),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "FastAdmit(call, heavy_request_bytes, chunk_cost_bytes, books, general, stop_if_abandoned)\n--\n\n"
              "The compiled fast path's admit for the common call; the general admit for every other.",
    .tp_new = FastAdmit_new,
    .tp_init = (initproc)FastAdmit_init,
    .tp_traverse = (traverseproc)FastAdmit_traverse,
    .tp_clear = (inquiry)FastAdmit_clear,
    .tp_dealloc = (destructor)FastAdmit_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(FastAdmit, vectorcall),
};

/* ---- the module ----------------------------------------------------------------------------------------- */

static PyMethodDef module_methods[] = {
    {"watch", (PyCFunction)(void (*)(void))watch, METH_FASTCALL,
     "watch(watched, seconds, ticket, on_unread, /)\n--\n\nDrainWatchdog.watch's entry for a Ticket."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "indexer_service.service.overload._budget",
    "The response budget's per-call bookkeeping in compiled code; see service/overload/budget.c.", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__budget(void) {
    if (!(str_held_per_answer_byte = PyUnicode_InternFromString("held_per_answer_byte")) ||
        !(str_peer = PyUnicode_InternFromString("peer")) || !(str_ticket = PyUnicode_InternFromString("ticket")) ||
        !(str_ended = PyUnicode_InternFromString("ended")) ||
        !(str_deadline = PyUnicode_InternFromString("deadline"))) {
        return NULL;
    }
    if (PyType_Ready(&BooksType) < 0 || PyType_Ready(&TicketType) < 0 || PyType_Ready(&FastAdmitType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Books", (PyObject *)&BooksType) < 0 ||
        PyModule_AddObjectRef(m, "Ticket", (PyObject *)&TicketType) < 0 ||
        PyModule_AddObjectRef(m, "FastAdmit", (PyObject *)&FastAdmitType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
