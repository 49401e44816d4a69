/* LD_PRELOAD shim (hicache_l3/engines/loopback.py): bind() on the wildcard address gets
 * loopback instead (for Mooncake, which binds 0.0.0.0 and [::] with no setting):
 *   AF_INET  0.0.0.0 -> 127.0.0.1
 *   AF_INET6 ::      -> ::ffff:127.0.0.1 on a dual-stack socket, ::1 when IPv6-only.
 * Binds to any other address pass through unchanged.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static bind_fn real_bind(void) {
    static bind_fn fn;
    if (!fn) fn = (bind_fn)dlsym(RTLD_NEXT, "bind");
    return fn;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    bind_fn next = real_bind();
    if (!next) {
        errno = ENOSYS;
        return -1;
    }
    if (addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return next(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr && addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            int v6only = 0;
            socklen_t optlen = sizeof v6only;
            if (getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &optlen) == 0 && !v6only) {
                static const unsigned char mapped[16] = {0, 0, 0, 0, 0, 0, 0, 0,
                                                         0, 0, 0xff, 0xff, 127, 0, 0, 1};
                memcpy(&a.sin6_addr, mapped, sizeof mapped);
            } else {
                a.sin6_addr = in6addr_loopback;
            }
            return next(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return next(fd, addr, len);
}
