/* The loss curve: metrics.jsonl's training (and eval) losses drawn as an SVG line plot,
 * output_dir/loss.svg at the end of a run (include/ddp/train.h). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/common.h"
#include "ddp/train.h"

/* The SVG: a 720x420 canvas, a plot area with a 10% margin, x = step, y = loss, a polyline
 * for the training loss and one for the eval loss, min/max labels on both axes. */
ddp_status_t ddp_train_plot_svg(const char *metrics_path, const char *svg_path, ddp_error_t *err) {
  DDP_REQUIRE(metrics_path && svg_path);
  char *text;
  DDP_CHECK(ddp__file_read(metrics_path, 0, -1, "loss plot", &text, NULL, err));
  size_t cap = 1024, n[2] = {0, 0};
  double *xs[2], *ys[2];
  xs[0] = ddp__malloc(cap * sizeof(double));
  ys[0] = ddp__malloc(cap * sizeof(double));
  xs[1] = ddp__malloc(cap * sizeof(double));
  ys[1] = ddp__malloc(cap * sizeof(double));
  char *svg = NULL;
  ddp_status_t st = DDP_ERR_NO_MEMORY;
  if (!xs[0] || !ys[0] || !xs[1] || !ys[1]) goto out;
  double xmin = INFINITY, xmax = -INFINITY, ymin = INFINITY, ymax = -INFINITY;
  for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
    cJSON *o = cJSON_Parse(line);
    if (!o) continue;
    const cJSON *step = cJSON_GetObjectItemCaseSensitive(o, "step");
    const cJSON *l0 = cJSON_GetObjectItemCaseSensitive(o, "loss");
    const cJSON *l1 = cJSON_GetObjectItemCaseSensitive(o, "eval_loss");
    for (int k = 0; k < 2; k++) {
      const cJSON *l = k ? l1 : l0;
      if (!cJSON_IsNumber(step) || !cJSON_IsNumber(l) || !isfinite(l->valuedouble)) continue;
      if (n[k] == cap) continue; /* the first `cap` points are plenty for a sketch */
      xs[k][n[k]] = step->valuedouble;
      ys[k][n[k]] = l->valuedouble;
      n[k]++;
      xmin = fmin(xmin, step->valuedouble);
      xmax = fmax(xmax, step->valuedouble);
      ymin = fmin(ymin, l->valuedouble);
      ymax = fmax(ymax, l->valuedouble);
    }
    cJSON_Delete(o);
  }
  if (n[0] + n[1] == 0) {
    xmin = 0;
    xmax = 1;
    ymin = 0;
    ymax = 1;
  }
  if (xmax <= xmin) xmax = xmin + 1;
  if (ymax <= ymin) ymax = ymin + 1;
  ymin = fmin(ymin, 0.0);
  const double W = 720, H = 420, L = 70, R = 20, T = 30, B = 50;
  size_t scap = 200000, len = 0;
  svg = ddp__malloc(scap);
  if (!svg) goto out;
#define EMIT(...)                                                                \
  do {                                                                           \
    if (len < scap) len += (size_t)snprintf(svg + len, scap - len, __VA_ARGS__); \
  } while (0)
  EMIT("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
       "font-family=\"sans-serif\" font-size=\"12\">\n",
       W, H);
  EMIT("<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
  EMIT("<text x=\"%.0f\" y=\"18\" text-anchor=\"middle\" font-size=\"14\">ddp-train loss"
       "</text>\n",
       W / 2);
  EMIT("<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\"/>\n", L, H - B,
       W - R, H - B);
  EMIT("<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\"/>\n", L, T, L,
       H - B);
  EMIT("<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">%g</text>\n", L, H - B + 16, xmin);
  EMIT("<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">%g</text>\n", W - R, H - B + 16, xmax);
  EMIT("<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">step</text>\n", (L + W - R) / 2, H - 12);
  EMIT("<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"end\">%.3g</text>\n", L - 6, H - B, ymin);
  EMIT("<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"end\">%.3g</text>\n", L - 6, T + 4, ymax);
  static const char *const colour[2] = {"#1f77b4", "#d62728"};
  static const char *const label[2] = {"train loss", "eval loss"};
  for (int k = 0; k < 2; k++) {
    if (!n[k]) continue;
    EMIT("<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" points=\"", colour[k]);
    for (size_t i = 0; i < n[k]; i++) {
      double px = L + (xs[k][i] - xmin) / (xmax - xmin) * (W - L - R);
      double py = (H - B) - (ys[k][i] - ymin) / (ymax - ymin) * (H - B - T);
      EMIT("%.1f,%.1f ", px, py);
    }
    EMIT("\"/>\n");
    EMIT("<text x=\"%.0f\" y=\"%.0f\" fill=\"%s\" text-anchor=\"end\">%s</text>\n", W - R - 4,
         T + 14 + 16 * k, colour[k], label[k]);
  }
  EMIT("</svg>\n");
#undef EMIT
  if (len >= scap) len = scap - 1;
  st = ddp__file_write_atomic(svg_path, svg, len, 0644, -1, "loss plot", err);
out:
  ddp__free(svg);
  for (int k = 0; k < 2; k++) {
    ddp__free(xs[k]);
    ddp__free(ys[k]);
  }
  ddp__free(text);
  return st;
}
