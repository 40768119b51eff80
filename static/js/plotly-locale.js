// Plotly in the page's language: Chinese month and day names, and charts whose modebar
// speaks Chinese, when the page is Chinese (<html lang="zh-CN">). Loaded after plotly.min.js.
(function () {
  if (!window.Plotly || document.documentElement.lang !== "zh-CN") return;
  Plotly.register({
    moduleType: "locale",
    name: "zh-CN",
    dictionary: {
      "Autoscale": "自动缩放", "Box Select": "矩形框选", "Double-click to zoom back out": "双击返回缩放",
      "Download plot as a png": "下载图表为 PNG 格式", "Download plot": "下载图表",
      "Lasso Select": "套索选择", "Pan": "平移", "Produced with Plotly.js": "由 Plotly.js 生成",
      "Reset axes": "重置轴", "Reset view": "重置视图", "Zoom": "缩放", "Zoom in": "放大",
      "Zoom out": "缩小", "Toggle Spike Lines": "切换显示数据点尖峰",
      "Show closest data on hover": "悬停时显示最近的数据",
      "Compare data on hover": "悬停时比较数据",
    },
    format: {
      days: ["星期日", "星期一", "星期二", "星期三", "星期四", "星期五", "星期六"],
      shortDays: ["周日", "周一", "周二", "周三", "周四", "周五", "周六"],
      months: ["一月", "二月", "三月", "四月", "五月", "六月", "七月", "八月", "九月", "十月", "十一月", "十二月"],
      shortMonths: ["1月", "2月", "3月", "4月", "5月", "6月", "7月", "8月", "9月", "10月", "11月", "12月"],
      date: "%Y-%m-%d",
      // The date axis' second line and its hover: "12月1日", not "12月 1, 2026".
      dayMonth: "%-m月%-d日",
      dayMonthYear: "%Y年%-m月%-d日",
      monthYear: "%Y年%-m月",
      year: "%Y年",
    },
  });
  Plotly.setPlotConfig({ locale: "zh-CN" });
})();
