/* The pod sandbox's process (what registry.k8s.io/pause runs): sleep until SIGTERM or SIGINT, reap
 * nothing else. Built static by build-node.sh into the image imported as the node's sandbox image. */
#include <signal.h>
#include <unistd.h>

static void quit(int sig) { _exit(sig == SIGTERM || sig == SIGINT ? 0 : 1); }

int main(void) {
    signal(SIGTERM, quit);
    signal(SIGINT, quit);
    for (;;)
        pause();
}
