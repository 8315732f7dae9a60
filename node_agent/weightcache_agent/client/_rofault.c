/* Say why an engine died when it wrote to a weight it attached read-only.
 *
 * The cpu backend maps the agent's arena PROT_READ: an in-place write to a weight (many
 * engines post-process weights after loading) is a SIGSEGV, which by itself reads like a
 * crash in torch. `install()` puts a SIGSEGV/SIGBUS handler in front of whatever handler is
 * there (faulthandler's, usually); `watch(address, length)` records a read-only range.
 * When a fault's address falls in a recorded range, the handler writes one line naming
 * the cause and the fixes to stderr. Either way it then puts the previous handler back and
 * returns: the faulting instruction runs again and the previous handler (faulthandler's
 * Python traceback, then the default action) takes over, so the process still dies with
 * SIGSEGV as before. Other threads faulting in a watched range meanwhile wait for that.
 *
 * Only async-signal-safe calls in the handler: write(2), sigaction(2) and pause(2). The ranges are a
 * fixed array written before the mapping is handed to Python, read with relaxed atomics.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define MAX_RANGES 256

static uintptr_t starts[MAX_RANGES], ends[MAX_RANGES];
static int used;  /* ranges recorded; a slot is filled before `used` covers it */
static struct sigaction previous_segv, previous_bus;
static int installed;
static int reported;  /* once: a write spread over threads faults in each of them */

static const char MESSAGE[] =
    "\nweightcache: the process wrote to a weight attached from the agent's arena, which is mapped read-only: "
    "the weights are shared with every engine on the node and nobody may change them in place. Clone the tensor "
    "before changing it (t = t.clone()), or attach with copy_on_write=True (cpu backend; each page written then "
    "costs a private copy).\n";

static int watched(uintptr_t address) {
    int n = __atomic_load_n(&used, __ATOMIC_ACQUIRE);
    for (int i = 0; i < n; i++)
        if (address >= starts[i] && address < ends[i])
            return 1;
    return 0;
}

static void on_fault(int signum, siginfo_t *info, void *context) {
    (void)context;
    if (info != NULL && watched((uintptr_t)info->si_addr)) {
        /* Another thread of the same write got here first: it reports, then the previous
         * handler ends the process. Handing this fault on too would race it there, and the
         * default action taken by one thread cuts short what faulthandler writes in the other. */
        if (__atomic_exchange_n(&reported, 1, __ATOMIC_ACQ_REL) != 0)
            for (;;)
                pause();
        ssize_t ignored = write(STDERR_FILENO, MESSAGE, sizeof(MESSAGE) - 1);
        (void)ignored;
    }
    /* Hand the fault on: the instruction faults again, now into the previous handler. */
    sigaction(signum, signum == SIGBUS ? &previous_bus : &previous_segv, NULL);
}

static PyObject *install(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_sigaction = on_fault;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    /* Again after someone else (faulthandler.enable()) took the signals: ours first once more. */
    struct sigaction current;
    if (sigaction(SIGSEGV, NULL, &current) == 0 && installed && current.sa_sigaction == on_fault)
        Py_RETURN_FALSE;
    if (sigaction(SIGSEGV, &action, &previous_segv) != 0 || sigaction(SIGBUS, &action, &previous_bus) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    installed = 1;
    Py_RETURN_TRUE;
}

static PyObject *watch(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long address, length;
    if (!PyArg_ParseTuple(args, "KK", &address, &length))
        return NULL;
    int n = __atomic_load_n(&used, __ATOMIC_ACQUIRE);
    for (int i = 0; i < n; i++)
        if (starts[i] == (uintptr_t)address && ends[i] == (uintptr_t)(address + length))
            Py_RETURN_TRUE;
    if (n >= MAX_RANGES)
        Py_RETURN_FALSE;  /* full: a fault there still gets faulthandler's traceback */
    starts[n] = (uintptr_t)address;
    ends[n] = (uintptr_t)(address + length);
    __atomic_store_n(&used, n + 1, __ATOMIC_RELEASE);
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"install", install, METH_NOARGS, "Put the read-only-weight fault handler in front of the current one."},
    {"watch", watch, METH_VARARGS, "watch(address, length): a read-only range whose faults get the message."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rofault", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rofault(void) { return PyModule_Create(&module); }
