# CPack: the Debian packages `dos` and `dos-dev` (cpack -G DEB in the build
# folder; README "Install"). The install rules with COMPONENT runtime / dev
# (daemon/, client/, proto/, deploy/) decide what goes in; everything else
# (test and benchmark binaries) stays out.
set(CPACK_PACKAGE_NAME dos)
set(CPACK_PACKAGE_VENDOR "DOS maintainers")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_CONTACT "${DOS_PACKAGE_MAINTAINER}")
# /etc/dos and /lib/systemd/system are absolute destinations: CPack installs
# through DESTDIR, with the prefix /usr (not CMAKE_INSTALL_PREFIX).
set(CPACK_SET_DESTDIR ON)
set(CPACK_INSTALL_PREFIX /usr)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_STRIP_FILES ON)
# Each package's description below: first line the synopsis, then the body
# (CPack indents it; an empty line becomes " .").

set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL runtime dev)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${DOS_PACKAGE_MAINTAINER}")
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_PACKAGE_HOMEPAGE "")
# Runtime library dependencies computed by dpkg-shlibdeps (package dpkg-dev);
# CUDA's runtime is linked statically (cudart_static) and the driver is loaded
# on first use, so there is no CUDA package dependency.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY "=")

set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME dos)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SECTION science)
set(CPACK_DEBIAN_RUNTIME_DESCRIPTION
    "Deep Optimizer States: host-memory Adam optimizer state daemon
dosd keeps the fp32 Adam/AdamW state of the trainers on a node in host
memory and updates it on the CPU and on otherwise idle GPU time; trainers
keep only their 16-bit weights and gradients and talk to it through
libdos_client (C ABI) or the dos Python package.

This package contains dosd with its systemd unit (enabled, not started),
the dos user and group, dosctl and libdos_client.")
# systemd-sysusers creates the dos user in postinst (systemd-tmpfiles and
# deb-systemd-helper are used where present).
set(CPACK_DEBIAN_RUNTIME_PACKAGE_DEPENDS "systemd | systemd-standalone-sysusers")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_CONTROL_EXTRA
    ${PROJECT_SOURCE_DIR}/deploy/debian/conffiles
    ${PROJECT_SOURCE_DIR}/deploy/debian/triggers
    ${PROJECT_SOURCE_DIR}/deploy/debian/postinst
    ${PROJECT_SOURCE_DIR}/deploy/debian/prerm
    ${PROJECT_SOURCE_DIR}/deploy/debian/postrm)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_CONTROL_STRICT_PERMISSION ON)

set(CPACK_DEBIAN_DEV_PACKAGE_NAME dos-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEV_DESCRIPTION
    "Deep Optimizer States: C and C++ headers of libdos_client
The C ABI (dos/dos.h), the header-only C++ wrapper (dos/dos.hpp), the
version header (dos/version.h) and the libdos_client.so link, for programs
that link libdos_client rather than load it at run time.")
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS "dos (= ${PROJECT_VERSION})")
set(CPACK_COMPONENT_DEV_DEPENDS runtime)

include(CPack)
